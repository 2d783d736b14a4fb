"""HTTP serving: router (OpenAI API), prefill and decode servers, launcher, demo."""
