"""Transports by name, as the command line chooses them: ``make_transport("nixl")``.

Engine modules are imported only when asked for, so ``import hawk.transport`` works on a machine that
has neither NIXL nor Mooncake, and a missing engine is reported with the pip package to install.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from hawk.transport.base import Transport, TransportUnavailable

# name -> (module, class, what to install when its import fails)
_ENGINES: dict[str, tuple[str, str, str]] = {
    "nixl": ("hawk.transport.nixl_transport", "NixlTransport", "pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1"),
    "mooncake": (
        "hawk.transport.mooncake_transport",
        "MooncakeTransport",
        "pip install mooncake-transfer-engine-non-cuda==0.3.13.post1 (or mooncake-transfer-engine-cuda13)",
    ),
    "local": ("hawk.transport.local", "LocalTransport", "nothing (built in)"),
    "cuda-ipc": ("hawk.transport.local", "CudaIpcTransport", "a CUDA build of torch"),
    # per peer: local (same process), cuda-ipc (same host, CUDA), else nixl / mooncake (transport/auto.py)
    "auto": ("hawk.transport.auto", "AutoTransport", "nothing (built in; NIXL or Mooncake for other hosts)"),
}
TRANSPORTS: tuple[str, ...] = tuple(_ENGINES)


def transport_class(name: str) -> type[Transport]:
    """The class behind ``name``; ValueError for an unknown name."""
    if name not in _ENGINES:
        raise ValueError(f"unknown transport {name!r}; choose one of {', '.join(TRANSPORTS)}")
    module, cls, hint = _ENGINES[name]
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise TransportUnavailable(f"transport {name!r} is not available ({e}); install: {hint}") from e


def make_transport(name: str, **options: Any) -> Transport:
    """Create the transport called ``name`` with engine ``options`` (e.g. protocol="rdma" for mooncake).

    Raises ValueError for an unknown name and TransportUnavailable (an ImportError) when the engine's
    package is missing; the message says what to pip install.
    """
    cls = transport_class(name)
    try:
        inspect.signature(cls).bind(**options)
    except TypeError as e:
        raise ValueError(f"bad options for transport {name!r}: {e}") from e
    try:
        return cls(**options)
    except TransportUnavailable:
        raise
    except ImportError as e:  # a system library missing under the engine (e.g. libibverbs for mooncake)
        hint = _ENGINES[name][2]
        raise TransportUnavailable(f"transport {name!r} could not load its engine ({e}); install: {hint}") from e


def available(name: str) -> bool:
    """Whether ``name`` can be created here (its engine imports; cuda-ipc also needs CUDA; auto always)."""
    try:
        cls = transport_class(name)
        if name == "nixl":
            from hawk.transport.nixl_transport import _load_nixl

            _load_nixl()
        elif name == "mooncake":
            from hawk.transport.mooncake_transport import _load_engine

            _load_engine()
        elif name == "cuda-ipc":
            import torch

            return bool(torch.cuda.is_available())
        return cls is not None
    except (TransportUnavailable, ImportError):
        return False
