"""Where every KV element lives on each device: GPU paged layouts, NPU tiled/interleaved layouts, tile codecs."""
