"""Index tables to the device without stalling the host.

The transform's tables and the batched device copies (``hawk.devices.batched_copy``) upload small int64
arrays before each launch. ``torch.as_tensor(arr, device="cuda")`` copies from pageable memory and
synchronizes the stream (tens of microseconds, and it waits for every kernel queued before it); through
pinned memory, enqueued on the device's current stream, the copy is ordered before the work launched
after it on that stream, and torch's caching host allocator keeps each pinned block until its copy has
run, so none is reused in flight.
"""

from __future__ import annotations

import numpy as np
import torch


def upload_int64(arr: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """``arr`` as an int64 tensor on ``device``: pinned and non-blocking on CUDA, a plain copy elsewhere
    (CPU, the Triton interpreter)."""
    a = np.ascontiguousarray(arr, dtype=np.int64)
    dev = torch.device(device)
    if dev.type != "cuda":
        return torch.from_numpy(a.copy()).to(dev)
    host = torch.empty(a.shape, dtype=torch.int64, pin_memory=True)
    host.numpy()[...] = a
    return host.to(dev, non_blocking=True)
