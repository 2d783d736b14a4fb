"""Loaded by Python at start-up in processes whose ``PYTHONPATH`` begins with this folder: the vLLM servers
of ``hawk bench vllm-pd``'s ``vllm-nixl-paused`` configuration. Their NIXL agents (vLLM's NixlConnector's)
then pause between progress sweeps as HAWK's own NIXL transport does (``HAWK_NIXL_PROGRESS_DELAY_US``,
200 us on hosts under 8 cores), instead of keeping a core busy each: not stock vLLM, a benchmark variant."""

import contextlib

with contextlib.suppress(ImportError):  # no NIXL: nothing to pause
    from hawk.transport.nixl_transport import pause_progress_threads

    pause_progress_threads()
