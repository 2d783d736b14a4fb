"""HawkConnector's settings: what a vLLM user writes in ``kv_connector_extra_config``.

    --kv-transfer-config '{"kv_connector": "HawkConnector",
                           "kv_connector_module_path": "hawk.integrations.vllm",
                           "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"transfer": "gn-hawk", "transport": "nixl"}}'

Unknown keys are refused at start (a typo must not silently fall back to a default).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hawk.connector.configs import CONFIGS
from hawk.errors import first_problem


class ConnectorSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    #: The transfer configuration (the paper's names). A producer sends in it; a vLLM consumer must use
    #: one that decodes on a GPU (gg-direct, gg-host), matching its prefill's.
    transfer: str = "gn-hawk"
    #: The transfer engine (hawk.transport.registry): nixl, mooncake, local, ...
    transport: str = "nixl"
    #: Where the prefill worker's KV control socket listens (Algorithm 1's D1 arrives there); port 0 picks a
    #: free one, which the worker reports to vLLM's scheduler through vLLM's handshake metadata.
    host: str = "127.0.0.1"
    port: int = Field(default=0, ge=0, le=65535)
    #: Prefill staging for formats that stage (npu-tiles, compact), in MiB.
    staging_mb: int = Field(default=256, ge=1)
    #: Decode receive buffer for landings that need one (gg-host), in MiB.
    rx_mb: int = Field(default=256, ge=1)
    #: How long prefilled KV waits for its pull before its blocks go back to vLLM (Algorithm 1's TTL).
    ttl_s: float = Field(default=30.0, gt=0)
    #: How long a pull that arrives before this prefill worker holds the request's blocks waits for them: vLLM
    #: answers the client (and so the decode learns the handle) before its worker's next step hands them over,
    #: and on a loaded host that step came more than 5 s later (a pull refused at a router's warm-up in CI).
    handoff_wait_s: float = Field(default=20.0, ge=0)
    #: How long a decode waits for one pull.
    pull_timeout_s: float = Field(default=30.0, gt=0)
    #: The transform's implementation: auto (Triton on CUDA, torch elsewhere), triton, torch.
    transform_impl: Literal["auto", "triton", "torch"] = "auto"

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> ConnectorSettings:
        try:
            s = cls.model_validate(dict(extra or {}))
        except ValidationError as e:
            raise ValueError(f"HawkConnector: bad kv_connector_extra_config ({first_problem(e, 'kv_connector_extra_config')})") from None
        if s.transfer not in CONFIGS:
            raise ValueError(f"HawkConnector: unknown transfer {s.transfer!r}; expected one of {sorted(CONFIGS)}")
        if CONFIGS[s.transfer].prefill_on != "gpu":
            raise ValueError(f"HawkConnector: {s.transfer} sends from an NPU; a vLLM prefill sends from its GPU (or CPU) cache")
        return s
