"""Algorithm 1: the prefill-side KV sender and the decode-side receiver."""
