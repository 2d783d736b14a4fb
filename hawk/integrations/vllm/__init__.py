"""HAWK inside vLLM: ``HawkConnector`` (a ``KVConnectorBase_V1``) for stock vLLM prefill and decode instances.

``kv_connector_module_path="hawk.integrations.vllm"``, ``kv_connector="HawkConnector"``; docs/vllm.md says
how to run it. vLLM is imported only when the connector is: the rest of this package (the KV handle,
the model export) works without it.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name in ("HawkConnector", "HawkStepMetadata", "HawkHandshake"):
        from hawk.integrations.vllm import connector

        return getattr(connector, name)
    raise AttributeError(name)
