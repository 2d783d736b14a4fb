"""A decode step's sampled tokens on their way to the host, so the next step can launch first.

A synchronous decode loop leaves the GPU idle while the host reads a step's tokens, emits them
and prepares the next step's metadata (0.1-0.3 ms of an 8B batch-1 step on an H200). vLLM's
async scheduling hides that: step N+1 is launched, its input ids taken on the device from step
N's sampled tokens, before the host waits for step N's. Here that needs the tokens twice: on the
device (the next step's ids) and on the host (the client's stream). :meth:`TokenFetcher.start`
queues their device-to-host copy into a pinned buffer behind the sampling kernels and records an
event, so waiting for step N later (:meth:`TokenFetch.result`) does not wait for step N+1, which
is queued behind it on the same stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class TokenFetch:
    """One step's tokens: ``device`` (int64 ``[n]``, None when the step sampled row by row on the
    host) and the host copy that :meth:`result` waits for."""

    device: torch.Tensor | None
    _host: torch.Tensor | None = None
    _event: Any = None
    _values: list[Any] | None = None

    def result(self) -> list[Any]:
        """The tokens (an ``Exception`` in place of a row whose sampling failed); waits for the copy."""
        if self._values is None:
            if self._event is not None:
                self._event.synchronize()
            assert self._host is not None
            self._values = self._host.tolist()
        return self._values

    @staticmethod
    def ready(values: list[Any]) -> TokenFetch:
        """Tokens the host already has (row-by-row sampling): nothing on the device to chain from."""
        return TokenFetch(None, _values=list(values))


class TokenFetcher:
    """Starts :class:`TokenFetch` es on one device through a ring of pinned buffers.

    ``slots``: how many fetches may be outstanding at once. An engine holds at most two (the step
    being read and the one launched after it); a slot is reused only after its copy has run.
    """

    def __init__(self, device: torch.device, max_rows: int, slots: int = 3) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        pin = self.cuda
        self._host = [torch.zeros(max_rows, dtype=torch.int64, pin_memory=pin) for _ in range(slots if pin else 0)]
        self._events: list[Any] = [None] * len(self._host)
        self._next = 0

    def start(self, tokens: torch.Tensor) -> TokenFetch:
        """Queue ``tokens`` ``[n]`` (int64, on this device) for the host, behind the work before it."""
        if not self.cuda:  # the tokens are computed: nothing to overlap
            return TokenFetch(tokens, _values=tokens.tolist())
        with torch.cuda.device(self.device):  # events and copies belong to the tokens' GPU
            return self._start(tokens)

    def _start(self, tokens: torch.Tensor) -> TokenFetch:
        n = tokens.shape[0]
        i = self._next
        self._next = (i + 1) % len(self._host)
        ev = self._events[i]
        if ev is None:
            ev = self._events[i] = torch.cuda.Event()
        else:
            ev.synchronize()  # its last copy has run (normally long since)
        host = self._host[i][:n]
        host.copy_(tokens, non_blocking=True)
        ev.record()
        return TokenFetch(tokens, host, ev)
