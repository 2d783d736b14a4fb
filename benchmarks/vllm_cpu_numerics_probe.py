"""Where HAWK's CPU decode step rounds differently from vLLM's CPU decode step, op by op.

Token identity between a vLLM prefill + HAWK decode and one vLLM instance needs HAWK's decode to
produce vLLM's bits. This probe runs vLLM in this process (``enforce_eager``, no multiprocessing),
captures every module's inputs and outputs on a prefill and the decode steps after it (forward hooks),
then feeds each of HAWK's ops *vLLM's own inputs* of that op and compares the outputs bit for bit, so
each op's difference is its own (not one inherited from the op before). Per op: elements compared,
elements that differ, and the largest difference in bf16 ulps (the prompt's attention too, as a colocated
prefill runs it). Then HAWK's whole prefill (its model on the prompt) and whole decode (its model over
vLLM's KV) against vLLM's logits. ``HAWK_CPU_ATTENTION=torch`` measures HAWK's torch attention instead
of vLLM's kernel (:mod:`hawk.engine.vllm_cpu_kernel`).

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/vllm_cpu_numerics_probe.py --model /tmp/smol \\
        --prompt-lens 32,256 --steps 3 --json /tmp/numerics.json

``--model``: an HF folder as ``hawk export-hf`` writes it (the one both vLLM and HAWK load).
"""

from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict
from typing import Any

import numpy as np
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 ulps between two tensors rounded to bf16 (ordered-integer view of the bits)."""
    def ordered(x: torch.Tensor) -> torch.Tensor:
        i = x.to(torch.bfloat16).contiguous().view(torch.int16).to(torch.int32)
        return torch.where(i < 0, -32768 - i, i)
    return (ordered(a) - ordered(b)).abs()


def compare(ours: torch.Tensor, theirs: torch.Tensor) -> dict[str, Any]:
    """Elements, elements differing, and the worst ulp distance (in the compared tensors' dtype)."""
    ours, theirs = ours.reshape(-1), theirs.reshape(-1)
    if ours.dtype == torch.float32 and theirs.dtype == torch.float32:
        diff = (ours != theirs)
        rel = ((ours - theirs).abs() / theirs.abs().clamp_min(1e-30)).max().item()
        return {"n": ours.numel(), "differ": int(diff.sum()), "max_rel": rel}
    d = ulps(ours, theirs)
    return {"n": ours.numel(), "differ": int((d > 0).sum()), "max_ulp": int(d.max())}


class Capture:
    """Every hooked module's (args, output) per call, cloned (vLLM's RoPE and fused norm work in place)."""

    def __init__(self) -> None:
        self.calls: dict[str, list[tuple[tuple, Any]]] = defaultdict(list)
        self._pending: dict[str, tuple] = {}

    def hook(self, name: str, module: torch.nn.Module) -> None:
        def pre(_m, args, kwargs):  # noqa: ANN001, ANN202
            self._pending[name] = (_clone(args), _clone(kwargs))

        def post(_m, _args, _kwargs, out):  # noqa: ANN001, ANN202
            self.calls[name].append((self._pending.pop(name), _clone(out)))

        module.register_forward_pre_hook(pre, with_kwargs=True)
        module.register_forward_hook(post, with_kwargs=True)


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, (tuple, list)):
        return type(x)(_clone(v) for v in x)
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    return x


def hook_vllm(model: torch.nn.Module, cap: Capture) -> None:
    """Hooks on the Llama modules whose outputs HAWK's ops reproduce."""
    m = model.model
    cap.hook("embed", m.embed_tokens)
    for i, layer in enumerate(m.layers):
        cap.hook(f"{i}.input_norm", layer.input_layernorm)
        cap.hook(f"{i}.qkv", layer.self_attn.qkv_proj)
        cap.hook(f"{i}.attn", layer.self_attn.attn)
        cap.hook(f"{i}.o_proj", layer.self_attn.o_proj)
        cap.hook(f"{i}.post_norm", layer.post_attention_layernorm)
        cap.hook(f"{i}.gate_up", layer.mlp.gate_up_proj)
        cap.hook(f"{i}.act", layer.mlp.act_fn)
        cap.hook(f"{i}.down", layer.mlp.down_proj)
    cap.hook("rope", m.layers[0].self_attn.rotary_emb)  # one module shared by every layer (vLLM's get_rope cache)
    cap.hook("final_norm", m.norm)
    cap.hook("logits", model.logits_processor)


def run_vllm(model_dir: str, prompts: list[list[int]], steps: int) -> tuple[list[Capture], list[list[int]]]:
    """One capture per prompt (its prefill and ``steps - 1`` decode forwards) and vLLM's greedy tokens."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="bfloat16", enforce_eager=True, kv_cache_memory_bytes=1 << 30,
              max_model_len=4096, enable_prefix_caching=False, seed=0)
    holder: dict[str, Capture] = {}

    def install(model: torch.nn.Module) -> None:
        cap = Capture()
        holder["cap"] = cap
        hook_vllm(model, cap)

    llm.apply_model(install)
    caps, toks = [], []
    for ids in prompts:
        holder["cap"].calls.clear()
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True))
        toks.append(list(out[0].outputs[0].token_ids))
        snap = Capture()
        snap.calls = holder["cap"].calls.copy()
        holder["cap"].calls = defaultdict(list)
        caps.append(snap)
    return caps, toks


def op_diffs(hawk: Any, cap: Capture, n_prompt: int) -> dict[str, list[dict[str, Any]]]:
    """Each HAWK op on vLLM's inputs of that op, per forward (the prefill's ops named "(prompt)"), per layer."""
    from hawk.engine.attention import attend
    from hawk.engine.model import linear, rope_torch
    from hawk.engine.triton_ops import silu_mul_ref

    cfg = hawk.config
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    n_calls = len(cap.calls["embed"])
    hawk.reserve_positions(n_prompt + n_calls)
    for step in range(n_calls):
        tag = " (prompt)" if step == 0 else ""  # the prefill forward, as a colocated prefill runs it

        def put(op: str, r: dict[str, Any], tag: str = tag) -> None:
            out[op + tag].append(r)

        (ids,), _ = cap.calls["embed"][step][0]
        put("embed", compare(hawk.embed(ids), cap.calls["embed"][step][1]))
        first = 0 if step == 0 else n_prompt + step - 1
        for i, layer in enumerate(hawk.layers):
            (args, kw), res = cap.calls[f"{i}.input_norm"][step]
            if len(args) + len(kw) >= 2 and (args[1:] or kw.get("residual")) is not None:
                x, r = args[0], (args[1] if len(args) > 1 else kw["residual"])
                h, r2 = layer.attn_norm.add_norm(x.clone(), r.clone(), False)
                put("add_rms_norm", compare(h, res[0]))
                put("residual_add", compare(r2, res[1]))
            else:
                put("rms_norm(first)", compare(layer.attn_norm.add_norm(args[0].clone(), None, False)[0], res))
            (args, _), res = cap.calls[f"{i}.qkv"][step]
            put("qkv_proj", compare(linear(args[0], layer.attn.wqkv), res[0]))
            (args, kw), res = cap.calls["rope"][step * cfg.num_layers + i]
            positions, q, k = args[0], args[1], args[2]
            assert int(positions[0]) == first, (positions, first)
            cos, sin_signed = hawk.rope.lookup(positions, q.dtype)
            put("rope_q", compare(rope_torch(q.view(-1, hq, d), cos, sin_signed), res[0]))
            put("rope_k", compare(rope_torch(k.view(-1, hkv, d), cos, sin_signed), res[1]))
            (args, _), res = cap.calls[f"{i}.attn"][step]
            k_ctx = torch.cat([cap.calls[f"{i}.attn"][s][0][0][1].view(-1, hkv, d) for s in range(step + 1)])
            v_ctx = torch.cat([cap.calls[f"{i}.attn"][s][0][0][2].view(-1, hkv, d) for s in range(step + 1)])
            o = attend(args[0].view(-1, hq, d), k_ctx, v_ctx)
            put("attention", compare(o.reshape(res.shape), res))
            (args, _), res = cap.calls[f"{i}.o_proj"][step]
            put("o_proj", compare(linear(args[0], layer.attn.wo.weight), res[0]))
            (args, kw), res = cap.calls[f"{i}.post_norm"][step]
            h, r2 = layer.mlp_norm.add_norm(args[0].clone(), args[1].clone(), False)
            put("add_rms_norm", compare(h, res[0]))
            put("residual_add", compare(r2, res[1]))
            (args, _), res = cap.calls[f"{i}.gate_up"][step]
            put("gate_up_proj", compare(linear(args[0], layer.mlp.w_gate_up), res[0]))
            (args, _), res = cap.calls[f"{i}.act"][step]
            put("silu_and_mul", compare(silu_mul_ref(args[0]), res))
            (args, _), res = cap.calls[f"{i}.down"][step]
            put("down_proj", compare(linear(args[0], layer.mlp.down.weight), res[0]))
        (args, kw), res = cap.calls["final_norm"][step]
        h, _ = hawk.norm.add_norm(args[0].clone(), args[1].clone(), False)
        put("final_add_rms_norm", compare(h, res[0]))
        (args, _), res = cap.calls["logits"][step]
        hidden = args[1]
        logits = hawk.compute_logits(hidden)
        put("lm_head(logits)", compare(logits, res.float()))
        put("logits_dtype", {"vllm": str(res.dtype), "hawk": str(logits.dtype)})
    return out


def whole_decode(hawk: Any, cap: Capture, n_prompt: int) -> list[dict[str, Any]]:
    """HAWK's model over vLLM's prompt KV, fed vLLM's tokens: its logits and argmax against vLLM's per step."""
    from hawk.engine.attention import ContiguousKVAttention

    cfg = hawk.config
    attn = ContiguousKVAttention(cfg.num_layers)
    attn.begin([0], [n_prompt])
    for i in range(cfg.num_layers):  # vLLM's prompt KV, as the connector would hand it over
        (args, _), _ = cap.calls[f"{i}.attn"][0]
        attn._k[0][i] = args[1].view(n_prompt, cfg.num_kv_heads, cfg.head_dim)
        attn._v[0][i] = args[2].view(n_prompt, cfg.num_kv_heads, cfg.head_dim)
    rows = []
    hawk.reserve_positions(n_prompt + len(cap.calls["embed"]))
    for step in range(1, len(cap.calls["embed"])):
        (ids,), _ = cap.calls["embed"][step][0]
        attn.begin([0], [1])
        hidden = hawk(ids, torch.tensor([n_prompt + step - 1]), attn)
        logits = hawk.compute_logits(hidden)
        ref = cap.calls["logits"][step][1].float()
        rows.append({"step": step, **compare(logits, ref), "argmax_same": bool(logits.argmax() == ref.argmax()),
                     "top2_gap_vllm": float(ref.topk(2).values.diff().abs().item())})
    return rows


def whole_prefill(hawk: Any, cap: Capture, ids: list[int]) -> dict[str, Any]:
    """HAWK's model on the prompt (its own prefill, as a colocated engine runs it): the last position's
    logits against vLLM's prefill logits."""
    from hawk.engine.attention import ContiguousKVAttention

    attn = ContiguousKVAttention(hawk.config.num_layers)
    attn.begin([0], [len(ids)])
    hidden = hawk(torch.tensor(ids), torch.arange(len(ids)), attn)
    logits = hawk.compute_logits(hidden[-1:])
    ref = cap.calls["logits"][0][1].float()
    return {**compare(logits, ref), "argmax_same": bool(logits.argmax() == ref.argmax())}


def summarize(per_op: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    out = {}
    for op, rs in per_op.items():
        if op.startswith("logits_dtype"):
            out[op] = rs[0]
            continue
        n, differ = sum(r["n"] for r in rs), sum(r["differ"] for r in rs)
        worst = max((r.get("max_ulp", 0) for r in rs), default=0)
        out[op] = {"elements": n, "differ": differ, "share": differ / max(1, n), "max_ulp": worst,
                   **({"max_rel": max(r["max_rel"] for r in rs)} if "max_rel" in rs[0] else {})}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompt-lens", default="32,256")
    p.add_argument("--steps", type=int, default=3, help="generated tokens per prompt (the first is the prefill's)")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    from hawk.engine.loader import load_model

    lens = [int(x) for x in a.prompt_lens.split(",")]
    prompts = [np.random.default_rng([s, n]).integers(1000, 10000, n).tolist() for n in lens for s in range(2)]
    caps, toks = run_vllm(a.model, prompts, a.steps)
    hawk = load_model(a.model, dtype=torch.bfloat16).model
    per_op: dict[str, list[dict[str, Any]]] = defaultdict(list)
    whole = []
    with torch.inference_mode():
        for ids, cap in zip(prompts, caps):
            for op, rs in op_diffs(hawk, cap, len(ids)).items():
                per_op[op].extend(rs)
            whole.append({"prompt_tokens": len(ids), "prefill": whole_prefill(hawk, cap, ids),
                          "steps": whole_decode(hawk, cap, len(ids))})
    result = {"ops": summarize(per_op), "whole_decode": whole, "vllm_tokens": toks}
    print(json.dumps(result, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
