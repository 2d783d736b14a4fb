"""KV-cache element types on each side and their torch equivalents."""

from __future__ import annotations

import torch

#: GPU-side KV dtypes (vLLM names them the same way) -> torch dtype.
GPU_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

#: NPU-side KV tile dtypes: ttnn's bfloat16 and bfloat8_b.
NPU_DTYPES = ("bf16", "bfp8_b")


def gpu_torch_dtype(name: str) -> torch.dtype:
    try:
        return GPU_DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown GPU KV dtype {name!r}; expected one of {sorted(GPU_DTYPES)}") from None


def gpu_dtype_name(dtype: torch.dtype) -> str:
    for name, td in GPU_DTYPES.items():
        if td == dtype:
            return name
    raise ValueError(f"unsupported GPU KV dtype {dtype}; expected one of {sorted(GPU_DTYPES)}")


def check_npu_dtype(name: str) -> str:
    if name not in NPU_DTYPES:
        raise ValueError(f"unknown NPU KV dtype {name!r}; expected one of {list(NPU_DTYPES)}")
    return name
