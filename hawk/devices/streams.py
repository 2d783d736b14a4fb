"""The calling thread's current CUDA stream as a kept torch Stream object, found by its raw handle.

Why: ``torch.cuda.current_stream()`` builds a new Stream object, with a device lookup, on every call,
which on the H200 host costs more than waiting for an idle stream; a landed pull's D7 and the sender's
wait or event record before D2 ask for the current stream on every transfer. The raw handle (and the
device) identify the stream, so a kept object stands for it.
"""

from __future__ import annotations

from typing import Any

from hawk.devices.cuda_runtime import raw_stream

#: Stream objects of current streams, by (device, raw handle).
_CURRENT: dict[tuple[int, int], Any] = {}
_CURRENT_MAX = 64


def current_stream(device_index: int) -> Any:
    """``torch.cuda.current_stream(device_index)``, kept per raw stream handle (see the module docstring)."""
    key = (device_index, raw_stream(device_index))
    s = _CURRENT.get(key)
    if s is None:
        import torch

        if len(_CURRENT) >= _CURRENT_MAX:
            _CURRENT.clear()
        s = _CURRENT[key] = torch.cuda.current_stream(device_index)
    return s


def synchronize_current(device_index: int) -> None:
    """Until the calling thread's current stream on CUDA device ``device_index`` has run (not the whole device)."""
    current_stream(device_index).synchronize()
