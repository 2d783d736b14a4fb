"""The few CUDA runtime calls HAWK makes without torch: async copies and events on torch's streams.

Why: on the H200 host a torch call that reaches CUDA costs microseconds of Python and dispatch
(2026-12-01, one H200: a 512-byte host-to-device ``copy_`` 13 us, ``Event.record()`` 8 us,
``torch.cuda.current_stream()`` 6 us; the same copy as a raw ``cudaMemcpyAsync`` 3.5 us). A decode
step's metadata uploads sit on its critical path (the graph replay waits for them), and so does
every call of a same-GPU transfer's submit.

The runtime is the one this process already loaded (found in /proc/self/maps, torch's own first),
so pointers and stream handles are torch's. :func:`runtime` is None where none is loaded or a
function is missing (CPU builds, ROCm), or where ``HAWK_RAW_CUDA=0`` turns these calls off; callers
then use torch's calls (the same work, at torch's host cost).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from typing import Any

log = logging.getLogger(__name__)

#: cudaMemcpyKind values.
HOST_TO_DEVICE, DEVICE_TO_DEVICE = 1, 3
_DISABLE_TIMING = 0x02  # cudaEventDisableTiming: the cheapest event to record and wait on
_NOT_READY = 600  # cudaErrorNotReady: what cudaEventQuery returns for an event still pending

_LOCK = threading.Lock()
_LOADED: dict[str, Any] = {}


class CudaRuntimeError(RuntimeError):
    """A raw CUDA runtime call returned an error code."""


class Runtime:
    """ctypes bindings of the runtime calls used here; each raises :class:`CudaRuntimeError` on an error."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        vp, sz, i = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int
        self._memcpy = lib.cudaMemcpyAsync
        self._memcpy.argtypes, self._memcpy.restype = [vp, vp, sz, i, vp], i
        self._create = lib.cudaEventCreateWithFlags
        self._create.argtypes, self._create.restype = [ctypes.POINTER(vp), ctypes.c_uint], i
        self._record = lib.cudaEventRecord
        self._record.argtypes, self._record.restype = [vp, vp], i
        self._query = lib.cudaEventQuery
        self._query.argtypes, self._query.restype = [vp], i
        self._sync = lib.cudaEventSynchronize
        self._sync.argtypes, self._sync.restype = [vp], i
        self._destroy = lib.cudaEventDestroy
        self._destroy.argtypes, self._destroy.restype = [vp], i
        self._wait = lib.cudaStreamWaitEvent
        self._wait.argtypes, self._wait.restype = [vp, vp, ctypes.c_uint], i

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise CudaRuntimeError(f"{what} returned CUDA error {rc}")

    def memcpy_async(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        """``nbytes`` from address ``src`` to ``dst`` on raw stream ``stream``."""
        self._check(self._memcpy(dst, src, nbytes, kind, stream), "cudaMemcpyAsync")

    def event_create(self) -> int:
        """A new event without timing, on the current device (the caller destroys it)."""
        ev = ctypes.c_void_p()
        self._check(self._create(ctypes.byref(ev), _DISABLE_TIMING), "cudaEventCreateWithFlags")
        return int(ev.value or 0)

    def event_record(self, event: int, stream: int) -> None:
        self._check(self._record(event, stream), "cudaEventRecord")

    def event_done(self, event: int) -> bool:
        rc = self._query(event)
        if rc == _NOT_READY:
            return False
        self._check(rc, "cudaEventQuery")
        return True

    def event_synchronize(self, event: int) -> None:
        """Until the work before the event's last record has run (at once if never recorded)."""
        self._check(self._sync(event), "cudaEventSynchronize")

    def stream_wait_event(self, stream: int, event: int) -> None:
        """Work enqueued on ``stream`` from now on waits for the work before ``event``'s last record."""
        self._check(self._wait(stream, event, 0), "cudaStreamWaitEvent")

    def event_destroy(self, event: int) -> None:
        self._destroy(event)  # at teardown: nothing to do about a failure


#: ``HAWK_RAW_CUDA=0``: no raw runtime calls (read at every :func:`runtime` call; for A/B runs and as a way out).
RAW_ENV = "HAWK_RAW_CUDA"


def runtime() -> Runtime | None:
    """The loaded CUDA runtime's bindings, or None (then use torch). Looked up once per process."""
    if os.environ.get(RAW_ENV, "1") == "0":
        return None
    with _LOCK:
        if "rt" not in _LOADED:
            _LOADED["rt"] = _load()
        return _LOADED["rt"]


def _load() -> Runtime | None:
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({ln.split()[-1] for ln in f if "libcudart.so" in ln and ln.split()[-1].startswith("/")})
    except OSError as e:
        log.info("no raw CUDA runtime calls (cannot read /proc/self/maps: %s)", e)
        return None
    paths.sort(key=lambda p: "/nvidia/" not in p)  # torch's own (the nvidia-* wheels) first
    if not paths:
        log.info("no raw CUDA runtime calls (no libcudart loaded in this process)")
        return None
    try:
        return Runtime(ctypes.CDLL(paths[0]))
    except (OSError, AttributeError) as e:
        log.info("no raw CUDA runtime calls (%s: %s)", paths[0], e)
        return None


def raw_stream(device_index: int) -> int:
    """The current stream of CUDA device ``device_index`` as a raw handle, without a Stream object."""
    import torch

    return int(torch._C._cuda_getCurrentRawStream(device_index))
