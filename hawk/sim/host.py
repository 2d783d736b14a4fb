"""Host staging as work done by the nodes' workers, not only as a delay of the KV.

A host-staged transfer (``gg-host``, ``gn-host``) passes through host memory on both nodes. In a
serving framework those copies are issued by the instance's worker (the process that also runs
the model), between its forward passes: the paper's §5.3.2 names "host intervention in the
evaluated vLLM implementation interfering with decode execution" as why the host-staged
configurations lose TPOT, and §5.3.1/§5.3.3 their TTFT. So here a staged transfer costs

* the **prefill worker** the device → host copy of each prompt's KV, after the forward that made
  it, before the next batch starts (its prefill is delayed);
* the **decode worker** the landing: host → device copies, and for ``gn-host`` the CPU-side
  tilize into the NPU's tile format before the writes into its DRAM channels; it runs between
  decode steps, so every running sequence waits for it (TPOT) and so does the request (TTFT).

The copies of one node are issued by its one worker, so they never overlap each other or the
engine's own PCIe traffic (the TP all-reduce of a PCIe A100 instance): the worker serializes
them, which is how staging and the engine share the node's PCIe and host-memory bandwidth here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class HostStaging:
    """Worker seconds per KV byte a host-staged transfer costs each side (0 = not staged there)."""

    prefill_s_per_byte: float = 0.0
    decode_s_per_byte: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        if self.prefill_s_per_byte < 0 or self.decode_s_per_byte < 0:
            raise ValueError(f"host staging costs must be non-negative, got {self.prefill_s_per_byte}, {self.decode_s_per_byte}")

    @classmethod
    def from_rates(cls, copy_gb_s: float, tilize_gb_s: float | None = None, source: str = "") -> HostStaging:
        """Both nodes copy every byte once at ``copy_gb_s`` (device -> host on the prefill, host ->
        device on the decode); with ``tilize_gb_s`` the decode host also tilizes every byte first
        (``gn-host``: the layout fix-up happens on the NPU node's CPU before the DRAM writes)."""
        if copy_gb_s <= 0 or (tilize_gb_s is not None and tilize_gb_s <= 0):
            raise ValueError(f"rates must be positive, got copy {copy_gb_s} GB/s, tilize {tilize_gb_s} GB/s")
        copy = 1 / (copy_gb_s * 1e9)
        tilize = 0.0 if tilize_gb_s is None else 1 / (tilize_gb_s * 1e9)
        return cls(copy, copy + tilize, source)

    def prefill_s(self, nbytes: float) -> float:
        """Prefill-worker time for staging ``nbytes`` of KV into host memory."""
        return nbytes * self.prefill_s_per_byte

    def decode_s(self, nbytes: float) -> float:
        """Decode-worker time for landing ``nbytes`` of staged KV in the decode device's cache."""
        return nbytes * self.decode_s_per_byte
