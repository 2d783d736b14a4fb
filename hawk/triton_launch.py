"""Launching a compiled Triton kernel again without Triton's Python dispatcher.

Why: an eager prefill launches about six Triton kernels per layer (190 for a 1k-token 8B forward).
Triton 3.6's dispatcher (``kernel[grid](...)``: bind, specialize, cache key, launch metadata, hooks,
a driver query per pointer) costs 15-21 us of host time per launch on the H200 host, the launcher
under it 5-7 us (``benchmarks/launch_overhead_probe.py``). When the forward's host time nears its
GPU time, the forward's thread no longer runs ahead, and a layer-wise push is no longer hidden.

:func:`launch` goes through the dispatcher the first time it sees a specialization, keeps the
compiled kernel, and afterwards calls its launcher directly. The key is what Triton specializes a
kernel on (the same facts, not its strings): each tensor argument's dtype and 16-byte alignment,
each int's ``== 1``, ``% 16 == 0`` and 32-bit range, the type of each float, the constexpr values
(keyword arguments), the launch options, and the current device. ``HAWK_TRITON_LAUNCH=jit`` turns
the direct path off; so does a Triton launch hook (a profiler's), and the interpreter never has one.

Knows only torch and Triton, so every layer that launches Triton kernels may use it.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

try:
    from triton import knobs as _knobs
except ImportError:  # CPU-only installs: nothing here is called without Triton
    _knobs = None  # type: ignore[assignment]

__all__ = ["DIRECT", "current_device_index", "launch", "launch_hooks_idle", "launchable", "on_device", "pointer_args",
           "raw_stream", "run_compiled"]

#: Whether :func:`launch` may call compiled kernels directly (``HAWK_TRITON_LAUNCH``: direct | jit):
#: not under the interpreter, nor with a torch built without CUDA.
DIRECT = (os.environ.get("HAWK_TRITON_LAUNCH", "direct") != "jit" and hasattr(torch._C, "_cuda_getDevice")
          and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"))
_INT32 = (-(2**31), 2**31 - 1)

#: Per kernel: {specialization key: compiled kernel, or None where the direct path does not apply}.
_compiled: dict[Any, dict[tuple, Any]] = {}
#: Per (kernel, number of positional arguments): the names of the parameters after them.
_rest_names: dict[tuple[Any, int], tuple[str, ...]] = {}


def launch_hooks_idle() -> bool:
    """Whether no Triton launch hook is installed, so a compiled kernel's launcher may be called
    directly without skipping one. Triton up to 3.4 keeps None there; 3.5 on an empty HookChain."""
    hooks = (_knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook)
    return all(h is None or getattr(h, "calls", None) == [] for h in hooks)


def raw_stream(index: int) -> int:
    """The current CUDA stream's handle on device ``index`` (what Triton's launcher takes)."""
    get = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if get is not None:
        return get(index)
    return torch.cuda.current_stream(index).cuda_stream


def run_compiled(compiled: Any, grid: tuple[int, ...], stream: int, args: tuple) -> None:
    """Call a compiled kernel's launcher directly (Triton 3.x's calling convention, in one place): ``grid``
    of up to three dimensions, the raw ``stream``, then every parameter in signature order, constexprs
    included (tensors as addresses where :func:`pointer_args` applies)."""
    g0, g1, g2 = (*grid, 1, 1)[:3]
    compiled.run(g0, g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None, *args)


def launchable(compiled: Any) -> bool:
    """Whether what the dispatcher returned can be launched by :func:`run_compiled` (a GPU-compiled kernel)."""
    return getattr(compiled, "function", None) is not None and hasattr(compiled, "packed_metadata")


def pointer_args(args: tuple) -> tuple:
    """``args`` with each tensor as its address, for a compiled kernel's launcher called directly: given an
    int, Triton's launcher takes it as the pointer, where for a tensor it calls ``data_ptr()`` and asks the
    driver whether the address is device memory (``cuPointerGetAttribute``), per pointer and launch. Only
    where the dispatcher has checked them once: its first launch of the same call (the transform's bound
    calls) or of the same specialization (:func:`launch`)."""
    return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """``device`` as the current CUDA device when it is not already (Triton launches on the current one);
    nothing to do otherwise, or off CUDA (torch's device guard costs more host time than a launch on the
    H200 host)."""
    switch = device.type == "cuda" and device.index != current_device_index()
    return torch.cuda.device(device) if switch else contextlib.nullcontext()


def current_device_index() -> int:
    """This thread's current CUDA device, for a caller that already holds CUDA tensors: torch's raw getter
    where it has one (``torch.cuda.current_device()`` checks CUDA's lazy initialization first, on every
    launch), else that."""
    get = getattr(torch._C, "_cuda_getDevice", None)
    return int(get()) if get is not None else torch.cuda.current_device()


def _fact(a: Any) -> Any:
    """What the dispatcher specializes a runtime argument on (its value for anything else)."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if isinstance(a, bool):
        return ("u1",)
    if isinstance(a, int):
        return (a == 1, a % 16 == 0, _INT32[0] <= a <= _INT32[1])
    if isinstance(a, float):
        return ("fp32",)
    return a


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)``, the dispatcher skipped once this specialization has run.

    ``args``: the kernel's runtime arguments, positionally; ``kwargs``: its constexprs and launch
    options (``num_warps``, ``num_stages``, ...). Launches on the current device and stream, as the
    dispatcher does; captured in a CUDA graph alike."""
    if not DIRECT:
        kernel[grid](*args, **kwargs)
        return
    dev = current_device_index()
    key = (dev, *map(_fact, args), *kwargs.items())
    table = _compiled.setdefault(kernel, {})
    try:
        compiled = table.get(key, False)
    except TypeError:  # an unhashable constexpr: the dispatcher handles it
        kernel[grid](*args, **kwargs)
        return
    if compiled and launch_hooks_idle():
        rest = [kwargs[n] for n in _rest(kernel, len(args))]
        run_compiled(compiled, grid, raw_stream(dev), (*pointer_args(args), *rest))
        return
    compiled = kernel[grid](*args, **kwargs)
    if key not in table:
        table[key] = _direct(kernel, compiled, len(args), kwargs)


def _rest(kernel: Any, n_args: int) -> tuple[str, ...]:
    return _rest_names[(kernel, n_args)]


def _direct(kernel: Any, compiled: Any, n_args: int, kwargs: dict[str, Any]) -> Any:
    """``compiled`` if later launches may call it directly: a GPU-compiled kernel whose parameters
    after the positional ones are all given by name (the launcher takes every parameter, constexprs
    included, in signature order); else None, and this specialization keeps the dispatcher."""
    if not launchable(compiled):
        return None
    names = tuple(getattr(kernel, "arg_names", ()))[n_args:]
    if not names and n_args != len(getattr(kernel, "arg_names", ())):
        return None
    if any(n not in kwargs for n in names):
        return None  # a defaulted parameter left out: its default is the dispatcher's business
    _rest_names[(kernel, n_args)] = names
    return compiled
