"""Discrete-event simulation of HAWK at cluster scale."""
