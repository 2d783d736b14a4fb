"""What HawkConnector's scheduler half tells its worker half each step (vLLM's connector metadata).

Plain data, pickled by vLLM between its scheduler and worker processes; no tensors, no vLLM types.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hawk.integrations.vllm.params import KVHandle


@dataclass(frozen=True)
class SendJob:
    """Prefill: request ``request_id`` finished with ``num_tokens`` prompt tokens of KV in ``block_ids``;
    hold them for a pull (the worker hands them to Algorithm 1's sender), give them back when done."""

    request_id: str
    num_tokens: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class RecvJob:
    """Decode: pull ``handle``'s KV into ``block_ids`` (allocated by vLLM for the prompt)."""

    request_id: str
    handle: KVHandle
    block_ids: tuple[int, ...]


@dataclass
class StepPlan:
    sends: list[SendJob] = field(default_factory=list)
    recvs: list[RecvJob] = field(default_factory=list)
    #: Decode: prefill address -> the KV request ids of requests still waiting here for their pull; the
    #: worker asks each prefill to keep their KV another TTL (Algorithm 1's KeepAlive)
    keep_alive: dict[str, list[str]] = field(default_factory=dict)
