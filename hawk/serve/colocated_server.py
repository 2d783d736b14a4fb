"""The colocated reference behind the same HTTP API: one process, prefill and decode, no transfer.

It answers both /internal/prefill and /internal/decode, so the router treats its URL as a prefill
instance and as a decode instance at once. The "KV handle" is the request id: the decode side takes
over the prefill's paged blocks as they are. This is the correctness oracle served end to end.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from hawk.engine.instances import ColocatedInstance
from hawk.serve.contract import DecodeRequest, InstanceInfo
from hawk.serve.decode_server import DecodeService, decode_routes
from hawk.serve.instance_app import build_instance_app, engine_stats
from hawk.serve.prefill_server import PrefillService, prefill_routes

COLOCATED_ADDRESS = "colocated"


def create_colocated_app(instance: ColocatedInstance, close_on_shutdown: bool = True, cluster_secret: str | None = None) -> FastAPI:
    cfg, mc = instance.cfg, instance.loaded.config
    prefill = PrefillService(instance.prefill, instance.discard, COLOCATED_ADDRESS, mc.vocab_size)

    def handle_for(req: DecodeRequest) -> list[int]:
        return instance.take_blocks(req.kv.request_id)

    def give_back(_: DecodeRequest, blocks: Any) -> None:
        instance.blocks.free(blocks)

    decode = DecodeService(instance.decode, handle_for, give_back)
    info = InstanceInfo.of(
        role="colocated", model=instance.loaded.name, transfer="colocated", transport=None, device=cfg.prefill_device,
        device_label=f"{cfg.prefill_device} (colocated reference, no KV transfer)", kv_address=COLOCATED_ADDRESS,
        max_prompt_tokens=instance.prefill.max_prompt_tokens, max_model_len=min(mc.max_position_embeddings, instance.decode.max_len),
        max_kv_tokens=instance.blocks.num_blocks * instance.blocks.block_size, vocab_size=mc.vocab_size,
        max_num_seqs=instance.decode.max_batch,
    )

    def accounting() -> dict[str, Any]:
        return {**instance.accounting(), **engine_stats(instance.decode), **prefill.aborts, **decode.aborts}

    return build_instance_app(
        "colocated", [prefill_routes(prefill), decode_routes(decode)], info, accounting, instance.loaded.tokenizer,
        instance.close if close_on_shutdown else None, [instance.prefill, instance.decode], cluster_secret,
    )
