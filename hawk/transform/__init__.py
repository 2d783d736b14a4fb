"""GPU-side transfer-aware transformation: paged cache -> NPU tiles grouped by DRAM channel.

``transform`` picks the fused Triton kernel on CUDA and the torch reference elsewhere; both write
the same bytes (tests hold them to it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch

from hawk.plan.kv_plan import KVTransferPlan, TileDest
from hawk.transform.reference import transform_reference, untransform_reference

IMPLS = ("auto", "triton", "torch")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _uses_triton(impl: str, caches: Sequence[torch.Tensor]) -> bool:
    """Whether ``impl`` means the fused Triton kernel for these caches (auto: on CUDA, where Triton is)."""
    if impl not in IMPLS:
        raise ValueError(f"unknown transform impl {impl!r}; expected one of {IMPLS}")
    return impl == "triton" or (impl == "auto" and caches[0].is_cuda and triton_available())


def transform(
    caches: Sequence[torch.Tensor], plan: KVTransferPlan, out: torch.Tensor | None = None, impl: str = "auto",
    dest: TileDest | None = None,
) -> torch.Tensor:
    """Write ``plan``'s tiles from the paged caches with the chosen implementation: into its send
    buffer, or where ``dest`` says (e.g. straight into the NPU's DRAM, :meth:`KVTransferPlan.memory_dest`)."""
    if _uses_triton(impl, caches):
        from hawk.transform.triton_kernel import transform_triton

        return transform_triton(caches, plan, out, dest=dest)
    return transform_reference(caches, plan, out, dest)


def bind(
    caches: Sequence[torch.Tensor], plan: KVTransferPlan, out: torch.Tensor, impl: str = "auto", dest: TileDest | None = None,
) -> Callable[[], None]:
    """``transform(caches, plan, out, impl, dest)`` as a call to repeat: each call writes the tiles of what
    the caches hold then. Why: a landed pull repeats one transform into the same pages, and the fused
    kernel's checks and launch setup (done once here) cost more host time than its launch. The call holds
    its arguments: valid while they are the same objects over the same storage (a sender's caches, a
    receiver's mapped memory)."""
    if _uses_triton(impl, caches):
        from hawk.transform.triton_kernel import bind_triton

        return bind_triton(caches, plan, out, dest)
    return functools.partial(transform_reference, caches, plan, out, dest)


def bind_layers(
    caches: Sequence[torch.Tensor], plan: KVTransferPlan, out: torch.Tensor, shifts: Sequence[int], impl: str = "auto",
    dest: TileDest | None = None,
) -> Callable[..., None]:
    """``transform([caches[l]], plan, out[shifts[l]:], impl, dest)`` for any layers ``l`` (``run(*layers)``)
    as one call to repeat (``plan``: one layer's, the same for every layer, as a layer-wise push's is).
    Why: a push transforms its layers on the forward's own thread, a group at a time, where every call's
    checks and setup cost more host time than the launch (the fused kernel's later layers are layer 0's
    launch with two addresses moved). Holds its arguments, as :func:`bind` does."""
    if _uses_triton(impl, caches):
        from hawk.transform.triton_kernel import bind_triton_layers

        return bind_triton_layers(caches, plan, out, shifts, dest)

    def run(*layers: int) -> None:
        for layer in layers:
            transform_reference([caches[layer]], plan, out[shifts[layer]:], dest)

    return run


def untransform(send: torch.Tensor, plan: KVTransferPlan, caches: Sequence[torch.Tensor]) -> None:
    """Reverse direction: tiles in send-buffer order -> the request's rows of the paged caches.

    Torch on any device (no fused kernel yet: it reads and writes each byte once per pass, a few passes).
    """
    untransform_reference(send, plan, caches)
