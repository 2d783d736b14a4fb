"""Device strings, parsed once: ``cpu``, ``cuda[:N]``, ``npu-emu:cpu``, ``npu-emu:cuda[:N]``, ``ttnn:N``.

Every option that names a device (``--prefill-device``, ``--decode-device``, ``--npu-device``) goes
through :func:`parse_device`, so "where does this memory live" and "is this an NPU" are answered
in one place instead of by string prefixes scattered over the tree. It imports nothing from hawk:
configuration, plans and benchmarks all use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["cpu", "cuda", "npu-emu", "ttnn"]
EXPECTED = "cpu, cuda[:N], npu-emu:cpu, npu-emu:cuda[:N] or ttnn:N"


@dataclass(frozen=True)
class DeviceSpec:
    """A parsed device string.

    ``torch_device`` is where the memory (and, for an emulated NPU, the decode math) lives, as
    torch names it; ``memory_kind`` is that without the index ("cpu" or "cuda"), which is what
    bandwidth tables are keyed by. A real NPU (``ttnn``) has no torch device.
    """

    kind: Kind
    torch_device: str
    text: str

    @property
    def is_npu(self) -> bool:
        return self.kind in ("npu-emu", "ttnn")

    @property
    def memory_kind(self) -> str:
        return "ttnn" if self.kind == "ttnn" else self.torch_device.partition(":")[0]

    def label(self, arch: str) -> str:
        """How the device is named to users: an emulated NPU says so, and where its memory is."""
        if self.kind == "npu-emu":
            return f"emulated {arch} NPU (memory on {self.torch_device})"
        if self.kind == "ttnn":
            return f"{arch} NPU ({self.text})"
        return self.torch_device


def _torch_device(text: str, whole: str) -> str:
    """``cpu``, ``cuda`` or ``cuda:N``; anything else is an unknown device."""
    if text == "cpu" or text == "cuda":
        return text
    head, _, index = text.partition(":")
    if head == "cuda" and index.isdigit():
        return f"cuda:{int(index)}"
    raise ValueError(f"unknown device {whole!r}; expected {EXPECTED}")


def parse_device(text: str) -> DeviceSpec:
    """Parse a device string; ValueError (naming the accepted forms) for anything else."""
    head, _, rest = text.strip().partition(":")
    if head == "npu-emu":
        return DeviceSpec("npu-emu", _torch_device(rest or "cpu", text), text)
    if head == "ttnn":
        if not rest.isdigit():
            raise ValueError(f"unknown device {text!r}; expected {EXPECTED}")
        return DeviceSpec("ttnn", "", text)
    torch_device = _torch_device(text.strip(), text)
    return DeviceSpec("cuda" if torch_device.startswith("cuda") else "cpu", torch_device, text)


def rank_device(text: str, rank: int) -> str:
    """The device of tensor-parallel rank ``rank`` of an instance placed on ``text``: a CUDA device
    ``cuda:N`` (plain or under ``npu-emu:``) moves to ``cuda:N+rank``, so a TP group takes
    consecutive GPUs as vLLM places one (NCCL refuses two ranks on one GPU); a CPU stays put."""
    spec = parse_device(text)
    if rank == 0 or not spec.torch_device.startswith("cuda"):
        return text
    index = int(spec.torch_device.partition(":")[2] or 0) + rank
    return f"npu-emu:cuda:{index}" if spec.kind == "npu-emu" else f"cuda:{index}"
