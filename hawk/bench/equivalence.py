"""Disaggregated vs colocated: the same prompts through each configuration, token ids compared.

The colocated instance (one model, one paged cache, no transfer) is the oracle; a disaggregated
run must produce the same greedy tokens when its KV dtype is the same (bf16). Each request's
TTFT (submit -> first token out of the decode instance, transfer included) and TPOT are
measured at the engine API, without HTTP in between.

    python -m hawk bench equivalence --model llama-3.1-8b --dtype bf16 --prefill-device cuda:0 \\
        --decode-device npu-emu:cuda:1 --configs gn-hawk,gg-direct --json out.json
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from hawk.engine.decode_engine import KVHandle, KVPush, TokenEvent
from hawk.engine.gc_policy import freeze_startup_heap
from hawk.config import TRANSFERS
from hawk.engine.instances import ColocatedInstance, DecodeInstance, InstanceConfig, PrefillInstance, compute_dtype
from hawk.engine.loader import load_model
from hawk.engine.sequence import SamplingParams
from hawk.layouts.device import parse_device

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about memory channels.",
    "List three prime numbers larger than 100.",
    "Explain in one sentence why decode is memory-bound.",
)


def _collect(submit: Any, timeout: float = 300.0, marks: dict[str, Any] | None = None) -> tuple[list[int], dict[str, Any]]:
    """Run one request to completion; returns its tokens and timing. ``marks``: what ``submit``
    recorded about the prefill (:func:`_prefilled`), turned into ``info["pieces_s"]``."""
    out: list[int] = []
    info: dict[str, Any] = {}
    times: list[float] = []
    done = threading.Event()

    def on(ev: TokenEvent) -> None:
        if ev.token is not None:
            out.append(ev.token)
            times.append(time.perf_counter())
        info.update(ev.info)
        if ev.finish_reason is not None:
            info["finish_reason"], info["error"] = ev.finish_reason, ev.error
            done.set()

    t0 = time.perf_counter()
    submit(on)
    if not done.wait(timeout):
        raise TimeoutError("request did not finish")
    if info.get("error"):
        raise RuntimeError(info["error"])
    info["ttft_s"] = times[0] - t0 if times else float("nan")
    info["tpot_s"] = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else float("nan")
    if marks and times:
        sent, done = marks["prefill_sent"], marks["prefill_done"]
        info["pieces_s"] = {
            "before_prefill_s": sent - t0,  # layer-wise: the decode's admission and hand-over
            "prefill_call_s": done - sent,  # submit to result, of which:
            "prefill_queue_s": marks.get("queue_s", 0.0), "prefill_engine_s": marks.get("prefill_s", 0.0),
            "after_prefill_s": times[0] - done,  # the first token through the decode
        }
    return out, info


def _prefilled(fut: Any, marks: dict[str, Any], sent: float) -> Any:
    """A prefill future's result, with when it was submitted and answered (and the engine's timings) in ``marks``."""
    r = fut.result(300)
    marks.update(r.timings, prefill_sent=sent, prefill_done=time.perf_counter())
    return r


def run_colocated(inst: ColocatedInstance, ids: list[int], params: SamplingParams, rid: str) -> tuple[list[int], dict]:
    marks: dict[str, Any] = {}

    def submit(on: Any) -> None:
        r = _prefilled(inst.prefill.submit(rid, ids, params), marks, time.perf_counter())
        inst.decode.submit(rid, r.num_prompt_tokens, r.first_token, params, inst.take_blocks(rid), on)

    return _collect(submit, marks=marks)


def run_disaggregated(p: PrefillInstance, d: DecodeInstance, ids: list[int], params: SamplingParams, rid: str) -> tuple[list[int], dict]:
    """One request through a prefill and a decode instance: prefill then pull, or (kv_flow=layerwise)
    decode first: the decode hands its blocks to the prefill, then the prefill runs and pushes."""
    marks: dict[str, Any] = {}
    if d.cfg.kv_flow == "layerwise":
        return _collect(lambda on: submit_layerwise(p, d, ids, params, rid, on, marks=marks), marks=marks)

    def submit(on: Any) -> None:
        r = _prefilled(p.engine.submit(rid, ids, params), marks, time.perf_counter())
        d.engine.submit(rid, r.num_prompt_tokens, r.first_token, params, KVHandle(p.kv_address, rid), on)

    return _collect(submit, marks=marks)


def submit_layerwise(p: PrefillInstance, d: DecodeInstance, ids: list[int], params: SamplingParams, rid: str, on: Any, wait_s: float = 300.0,
                     marks: dict[str, Any] | None = None) -> KVPush:
    """Decode first: admit at the decode (its blocks go to the prefill as the destination), then
    prefill as the destination leaves (the prefill expects it); the first token reaches the decode
    with the pushed KV. Returns the handle."""
    handle = KVPush(p.kv_address, rid)
    p.sender.expect(rid)
    d.engine.submit(rid, len(ids), 0, params, handle, on)
    handle.handed.wait(wait_s)  # the decode has admitted it and its destination is on the way
    try:
        sent = time.perf_counter()
        r = _prefilled(p.engine.submit(rid, ids, params), marks if marks is not None else {}, sent)
    except BaseException as e:
        handle.first_token.set_exception(e)
        p.discard(rid)
        raise
    handle.first_token.set_result(r.first_token)
    return handle


def config_for(base: InstanceConfig, name: str) -> InstanceConfig:
    """``base`` with transfer ``name``; a GPU-decoding configuration decodes on the NPU's backing
    device (so one ``--decode-device npu-emu:cuda:1`` serves every configuration of a run)."""
    cfg = replace(base, transfer=name)
    decode = parse_device(cfg.decode_device)
    if TRANSFERS[name] == "gpu" and decode.is_npu:
        cfg = replace(cfg, decode_device=decode.torch_device)
    return cfg


def encode_prompts(tokenizer: Any, prompts: Sequence[str]) -> list[list[int]]:
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}])) for p in prompts]


def run(base: InstanceConfig, configs: Sequence[str], prompts: Sequence[str] = PROMPTS, max_tokens: int = 24) -> list[dict[str, Any]]:
    """One record per (configuration, prompt): tokens equal to the oracle's, TTFT, TPOT, KV bytes."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=False)
    oracle_model = load_model(base.model, base.prefill_device, compute_dtype(base), base.seed)
    oracle = ColocatedInstance(replace(base, transfer="colocated"), loaded=oracle_model)
    ids = encode_prompts(oracle_model.tokenizer, prompts)
    reference = []
    try:
        for i, x in enumerate(ids):
            run_colocated(oracle, x, params, f"warm{i}") if i == 0 else None
            reference.append(run_colocated(oracle, x, params, f"ref{i}"))
    finally:
        oracle.close()
    records = []
    for name in configs:
        cfg = config_for(base, name)
        p = PrefillInstance(cfg, loaded=oracle_model)
        d = DecodeInstance(cfg)
        if base.gc_freeze:  # as each serving process does once it is up
            freeze_startup_heap()
        try:
            run_disaggregated(p, d, ids[0], params, "warm")
            for i, x in enumerate(ids):
                toks, info = run_disaggregated(p, d, x, params, f"{name}-{i}")
                ref_toks, ref_info = reference[i]
                records.append(
                    {
                        "config": name,
                        "prompt": i,
                        "identical": toks == ref_toks,
                        "tokens": len(toks),
                        "agreement": sum(a == b for a, b in zip(toks, ref_toks)) / max(1, len(ref_toks)),
                        "ttft_ms": info["ttft_s"] * 1e3,
                        "tpot_ms": info["tpot_s"] * 1e3,
                        "colocated_ttft_ms": ref_info["ttft_s"] * 1e3,
                        "colocated_tpot_ms": ref_info["tpot_s"] * 1e3,
                        "kv_transfer_ms": info.get("kv_transfer_s", 0) * 1e3,
                        "kv_bytes": info.get("kv_bytes", 0),
                        "kv_requests": info.get("kv_requests", 0),
                        "kv_mode": info.get("kv_mode", ""),
                        "model": base.model,
                        "dtype": base.dtype,
                        "kv_dtype": cfg.kv_dtype if name.startswith("gn") else cfg.gpu_kv_dtype,
                        "prefill_device": cfg.prefill_device,
                        "decode_device": cfg.decode_device + (" (emulated NPU)" if parse_device(cfg.decode_device).is_npu else ""),
                        "transport": cfg.transport,
                        "prefill_tp": cfg.prefill_tp,
                        "decode_tp": cfg.decode_tp,
                        "text": oracle_model.tokenizer.decode(toks),
                    }
                )
        finally:
            d.close()
            p.close()
    return records


def summarize(records: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for name in dict.fromkeys(r["config"] for r in records):
        rs = [r for r in records if r["config"] == name]
        out[name] = {
            "identical": all(r["identical"] for r in rs),
            "ttft_ms_median": statistics.median(r["ttft_ms"] for r in rs),
            "tpot_ms_median": statistics.median(r["tpot_ms"] for r in rs),
            "colocated_tpot_ms_median": statistics.median(r["colocated_tpot_ms"] for r in rs),
            "kv_transfer_ms_median": statistics.median(r["kv_transfer_ms"] for r in rs),
        }
    return out


def equivalence(base: InstanceConfig, configs: Sequence[str], max_tokens: int = 24, json_path: str | None = None) -> list[dict[str, Any]]:
    """Run ``configs`` against the colocated oracle built from ``base``; print a summary per
    configuration and write the records to ``json_path`` when given."""
    torch.manual_seed(0)
    records = run(base, list(configs), max_tokens=max_tokens)
    for name, s in summarize(records).items():
        print(name, json.dumps(s))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(records, f, indent=1)
    return records


def teacher_forced_divergence(loaded: Any, prompt_ids: list[int], steps: int, kv_dtype: str, arch: str = "blackhole-p150a") -> dict[str, float]:
    """How far decoding from the NPU cache in ``kv_dtype`` drifts from the bf16 colocated reference.

    Both decoders are fed the reference's own tokens (teacher forcing), so every step compares
    logits over the same context: the max absolute logit difference and how often the argmax agrees.
    """
    from hawk.devices.emulated import open_npu
    from hawk.engine.npu_attention import NpuTileAttention
    from hawk.engine.paged_attention import PagedAttention, SeqSlice
    from hawk.engine.runner import ModelRunner
    from hawk.layouts.gpu import GpuKVLayout
    from hawk.layouts.npu import NpuKVLayout
    from hawk.memory.npu_kv_cache import NpuKVCacheMemory
    from hawk.plan.kv_plan import plan_kv_transfer
    from hawk.transform import transform

    model, mc = loaded.model, loaded.config
    n = len(prompt_ids) + steps
    glay = GpuKVLayout(mc.num_layers, -(-n // 16) + 1, 16, mc.num_kv_heads, mc.head_dim, "bf16")
    caches = glay.allocate(model.device)
    gblocks = list(range(glay.num_blocks))
    ref = ModelRunner(model, PagedAttention(glay, caches))
    first = ref.forward([prompt_ids], [SeqSlice(gblocks, 0, len(prompt_ids))])[0]

    npu = open_npu("npu-emu:cpu", arch, bank_capacity=64 << 20)
    nlay = NpuKVLayout(npu.arch, mc.num_layers, -(-n // 64) + 1, mc.num_kv_heads, 64, mc.head_dim, kv_dtype)
    kv = NpuKVCacheMemory(npu, nlay)
    nblocks = list(range(nlay.max_num_blocks))
    plan = plan_kv_transfer(len(prompt_ids), gblocks, nblocks, glay, nlay, kv.bases)
    send = transform(caches, plan)
    pb = plan.page_bytes
    a, b = (torch.as_tensor(x) for x in plan.offset_terms())
    for t in range(plan.num_tensors):  # land the pages where the plan puts them
        kv.write_pages(t, torch.as_tensor(plan.page), send.view(-1, pb)[(a + t * b) // pb])
    npu_run = ModelRunner(model, NpuTileAttention(kv))

    token = int(first.argmax())
    max_diff, agree = 0.0, 0
    for i in range(steps):
        pos = len(prompt_ids) + i
        lr = ref.forward([[token]], [SeqSlice(gblocks, pos, 1)])[0]
        ln = npu_run.forward([[token]], [SeqSlice(nblocks, pos, 1)])[0]
        max_diff = max(max_diff, float((lr - ln).abs().max()))
        agree += int(lr.argmax() == ln.argmax())
        token = int(lr.argmax())
    kv.close()
    return {"steps": steps, "max_logit_diff": max_diff, "argmax_agreement": agree / steps, "logit_range": float(lr.max() - lr.min())}
