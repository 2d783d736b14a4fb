"""What vLLM registered, described: the per-layer caches in layer order and their layout as data.

The layout is read from the tensors ``register_kv_caches`` receives and from what vLLM itself chose (the
attention backend, and on the CPU the kernel's ISA, which orders the elements inside a block), never
guessed: ``hawk.layouts.vllm.from_registered`` checks the tensors against the description.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from hawk.layouts.paged import PagedKVLayout
from hawk.layouts.vllm import CPU_BACKEND, from_registered


def _layer_index(name: str) -> int:
    """``model.layers.12.self_attn.attn`` -> 12 (vLLM names attention layers by their module path)."""
    m = re.search(r"\.(\d+)\.", name)
    if m is None:
        raise ValueError(f"cannot tell the layer index of KV cache {name!r}")
    return int(m.group(1))


def describe_registered(vllm_config: Any, kv_caches: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], PagedKVLayout]:
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    names = sorted(kv_caches, key=_layer_index)
    if [_layer_index(n) for n in names] != list(range(len(names))):
        raise ValueError(f"HawkConnector expects one KV cache per decoder layer 0..L-1, got {names[:4]}...")
    layers = get_layers_from_vllm_config(vllm_config, Attention, names)
    first = layers[names[0]]
    backend = first.get_attn_backend().get_name()
    isa = getattr(first, "isa", None)
    if backend == CPU_BACKEND and isa is None:  # set by vLLM's CPU metadata builder, normally before this call
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(vllm_config.model_config.dtype, vllm_config.cache_config.block_size, first.head_size,
                            vllm_config.cache_config.cache_dtype)
    ordered = {n: kv_caches[n] for n in names}
    layout = from_registered(ordered, backend, isa, first.head_size)
    return list(ordered.values()), layout
