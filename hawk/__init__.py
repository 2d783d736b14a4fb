"""HAWK: heterogeneity-aware KV-cache transfer for GPU-prefill / NPU-decode disaggregated LLM serving.

Data flows one way through the subpackages:
layouts -> plan -> transform -> devices/memory -> transport -> connector -> engine -> serve; bench and sim on top.
A module imports only from the ones before it.
"""

__version__ = "0.1.0"
