"""Where every KV element lives on each device: GPU paged layouts (HAWK's NHD / HND / vec, and any engine's as a
hierarchical layout: vLLM 0.32's in ``vllm.py``), NPU tiled/interleaved layouts, tile codecs."""
