"""Record the per-layer KV cache views vLLM's own functions build, for every KVCacheLayout (needs vLLM).

    python scripts/vllm_kv_layouts.py            # print the record
    python scripts/vllm_kv_layouts.py --write    # rewrite tests/data/vllm_kv_layouts.json

For each shape and stride order, the views come from vLLM's ``compute_layout_strides`` and
``create_kv_cache_views`` over one buffer, with the layer and block strides chosen as
``get_kv_cache_config_from_groups`` chooses them; each layer's shape, strides and storage offset are
recorded in elements. Also recorded: which layouts the GPU backends declare (None: any) and the one
vLLM picks for them by default. The tests hold HAWK's descriptions to this file, and the GPU test
builds its caches from it (vLLM is not installed on the GPU box).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "vllm_kv_layouts.json"
#: (name, layers, blocks, kv heads, block size, head_dim): SmolLM2-135M's heads on a small cache, and an
#: 8B-shaped rank (8 KV heads, head_dim 128, vLLM's GPU block size 16).
SHAPES = [("smollm2", 3, 7, 3, 16, 64), ("llama8b", 4, 9, 8, 16, 128)]
BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER")


def _views(kv_layout: str, layers: int, blocks: int, heads: int, block_size: int, head_dim: int) -> list[dict]:
    from vllm.v1.core.kv_cache_utils import _get_kv_cache_bytes_per_block
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheGroupSpec,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[kv_layout]
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_dim, dtype=torch.bfloat16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    per_block = _get_kv_cache_bytes_per_block([KVCacheGroupSpec(names, spec)], layout)
    layer_stride, block_stride, *_ = compute_layout_strides(
        spec, blocks, layers, layout, fixed_strides=(None, per_block if layout.is_block_outermost else None, None, None, None))
    tensor = KVCacheTensor(size=per_block * blocks, layers=names, layer_stride=layer_stride, block_stride=block_stride)
    raw = torch.zeros(tensor.size, dtype=torch.int8)
    return [{"shape": list(v.shape), "stride": list(v.stride()), "offset": v.storage_offset(), "dtype": str(v.dtype).removeprefix("torch.")}
            for v in create_kv_cache_views(raw, spec, blocks, layout, tensor)]


def _backends() -> dict:
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts

    out = {}
    for name in BACKENDS:
        mod = {"FLASH_ATTN": "flash_attn", "TRITON_ATTN": "triton_attn", "FLASHINFER": "flashinfer"}[name]
        try:
            module = __import__(f"vllm.v1.attention.backends.{mod}", fromlist=["x"])
        except Exception as e:  # noqa: BLE001 - a backend this build cannot import is recorded as such
            out[name] = {"error": f"{type(e).__name__}: {e}"[:200]}
            continue
        cls = next(c for c in vars(module).values() if isinstance(c, type) and getattr(c, "get_name", None) and _name(c) == name)
        declared = cls.supported_kv_cache_layouts()
        out[name] = {"declared": None if declared is None else [m.name for m in declared],
                     "default": get_supported_kv_cache_layouts([cls])[0].name}
    return out


def _name(cls: type) -> str | None:
    try:
        return cls.get_name()
    except Exception:  # noqa: BLE001 - abstract bases
        return None


def generate() -> dict:
    import vllm
    from vllm.v1.kv_cache_layout import KVCacheLayout

    cases = []
    for name, layers, blocks, heads, block_size, head_dim in SHAPES:
        for kv_layout in (m.name for m in KVCacheLayout):
            cases.append({"shape": name, "kv_layout": kv_layout, "layers": layers, "blocks": blocks, "heads": heads,
                          "block_size": block_size, "head_dim": head_dim,
                          "views": _views(kv_layout, layers, blocks, heads, block_size, head_dim)})
    return {"vllm": vllm.__version__, "backends": _backends(), "cases": cases}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help=f"rewrite {OUT.relative_to(OUT.parents[2])}")
    args = ap.parse_args()
    text = json.dumps(generate(), indent=1) + "\n"
    if args.write:
        OUT.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
