"""HTTP serving: router (OpenAI API), prefill and decode servers, launcher, demo.

protocol          OpenAI request/response models and the error shape
contract          the typed, versioned router <-> instance messages
errors            named faults -> HTTP status, in one table
prefill_server    the prefill instance over HTTP (/internal/prefill, /internal/abort)
decode_server     the decode instance over HTTP (/internal/decode, /internal/decode_events: NDJSON token lines)
colocated_server  the colocated reference behind the same two endpoints
instance_app      what every instance app answers (/health, /internal/info, /internal/accounting, /metrics)
decode_lines      the router's end of those lines: a stream per request, or one shared per decode instance
generation        one request's path through the router: prefill -> decode -> text, stop strings, timings
router            the OpenAI-compatible front door (/v1/completions, /v1/chat/completions, /v1/models, /metrics)
launcher          serve(): the whole system or one role; start_system() for the demo and tests
demo              demo(): start, send a few requests, print answers and timings, stop

Entry points: ``hawk.serve.launcher.serve(cfg)`` and ``hawk.serve.demo.demo(cfg)``, with ``cfg`` a
``hawk.config.ServeConfig``; their command lines are generated from it.
"""
