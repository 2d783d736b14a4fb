"""Benchmarks: transform throughput, transfer latency (paper Fig. 9), serving."""
