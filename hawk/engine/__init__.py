"""The model and the prefill / decode engines around it."""
