"""Devices that hold KV memory: the emulated Tenstorrent-like NPU and the seam for a real backend."""
