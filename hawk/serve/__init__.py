"""HTTP serving: router (OpenAI API), prefill and decode servers, launcher, demo.

protocol          OpenAI request/response models and the error shape
prefill_server    the prefill instance over HTTP (/internal/prefill, /internal/abort)
decode_server     the decode instance over HTTP (/internal/decode streams NDJSON token events)
colocated_server  the colocated reference behind the same two endpoints
instance_app      what every instance app answers (/health, /internal/info, /internal/accounting, /metrics)
generation        one request's path through the router: prefill -> decode -> text, stop strings, timings
router            the OpenAI-compatible front door (/v1/completions, /v1/chat/completions, /v1/models, /metrics)
launcher          serve(): the whole system or one role; start_system() for the demo and tests
demo              demo(): start, send a few requests, print answers and timings, stop

Entry points for the command line: ``hawk.serve.launcher.serve`` and ``hawk.serve.demo.demo``.
"""
