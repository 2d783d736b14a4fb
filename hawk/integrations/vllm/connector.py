"""``HawkConnector``: HAWK's transfer as a vLLM ``KVConnectorBase_V1``.

Load it into a stock vLLM server with::

    --kv-transfer-config '{"kv_connector": "HawkConnector", "kv_connector_module_path": "hawk.integrations.vllm",
                           "kv_role": "kv_producer", "kv_connector_extra_config": {"transfer": "gn-hawk"}}'

vLLM builds one connector per process: the scheduler's (``SchedulerHalf``: which blocks to hold, which
prompts to load) and each worker's (``WorkerHalf``: Algorithm 1 over the registered cache). This class
only translates vLLM's calls into theirs; the lifecycle is stated in scheduler_half.py.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)

from hawk.integrations.vllm.plan import StepPlan
from hawk.integrations.vllm.scheduler_half import SchedulerHalf
from hawk.integrations.vllm.settings import ConnectorSettings
from hawk.integrations.vllm.vllm_cache import describe_registered
from hawk.integrations.vllm.worker_half import WorkerHalf

log = logging.getLogger(__name__)


class HawkStepMetadata(KVConnectorMetadata):
    """The scheduler half's StepPlan, in the type vLLM passes to the workers."""

    def __init__(self, plan: StepPlan):
        self.plan = plan


class HawkHandshake(KVConnectorHandshakeMetadata):
    """A worker's KV control address, sent to the scheduler by vLLM after the caches are registered."""

    def __init__(self, address: str):
        self.address = address


class HawkConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        tc = vllm_config.kv_transfer_config
        settings = ConnectorSettings.from_extra(tc.kv_connector_extra_config)
        producer, consumer = bool(tc.is_kv_producer), bool(tc.is_kv_consumer)
        tp = vllm_config.parallel_config.tensor_parallel_size
        if tp != 1:
            raise ValueError(f"HawkConnector runs with tensor_parallel_size 1 (got {tp}); see docs/vllm.md")
        self._sched = SchedulerHalf(settings, producer, consumer) if role == KVConnectorRole.SCHEDULER else None
        self._worker = WorkerHalf(settings, producer, consumer) if role == KVConnectorRole.WORKER else None

    # -- worker side -----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        caches, layout = describe_registered(self._vllm_config, kv_caches)
        self._worker.register(caches, layout)
        log.info("HawkConnector worker: %s, %d layers, KV control at %s", type(layout).__name__, len(caches), self._worker.address)

    def get_handshake_metadata(self) -> HawkHandshake | None:
        return HawkHandshake(self._worker.address) if self._worker is not None and (self._worker.sender or self._worker.receiver) else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, HawkStepMetadata)
        self._worker.start(meta.plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # pulls complete between steps (the request is scheduled once received)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # the KV is pulled after the request finishes (Algorithm 1's pull flow)

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self._worker is not None
        sent, loaded = self._worker.finished()
        return sent or None, loaded or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # -- scheduler side --------------------------------------------------------------------------

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        assert self._sched is not None
        self._sched.set_worker_address({rank: m.address for rank, m in metadata.items() if isinstance(m, HawkHandshake)})

    def on_new_request(self, request: Any) -> None:
        assert self._sched is not None
        self._sched.arrived(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._sched is not None
        return self._sched.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._sched is not None
        self._sched.allocated(request, list(blocks.get_block_ids()[0]), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> HawkStepMetadata:
        assert self._sched is not None
        return HawkStepMetadata(self._sched.take_plan())

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._sched is not None
        return self._sched.finished(request, block_ids)
