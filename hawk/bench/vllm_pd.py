"""``hawk bench vllm-pd``: vLLM's own P/D beside HAWK inside vLLM and HAWK alone, one box, one run.

Configurations (each started, warmed, measured, stopped in turn; the same model folder for all):

  vllm-single        one stock vLLM server
  vllm-nixl          vLLM prefill -> vLLM decode over vLLM's NixlConnector (vLLM's own P/D, its standard handoff)
  vllm-nixl-paused   the same, not stock: its NIXL agents pause between progress sweeps as HAWK's NIXL transport's
                     do (``nixl_pause/sitecustomize.py``); stock, each keeps a core busy, which on a small CPU
                     box starves the engines (benchmarks/vllm_prefill_spin_probe.py)
  hawk-gg-direct     vLLM prefill -> vLLM decode over HawkConnector (gg-direct: blocks read in place), in the
                     prompt+first-token handoff (hawk/integrations/vllm/handoff.py; ``--gg-handoff standard``: vLLM's)
  hawk-gn-hawk       vLLM prefill (HawkConnector) -> HAWK's decode on the emulated NPU, bf16 tiles, HAWK's router
  hawk-gn-hawk-bfp8  the same with bfloat8_b tiles (lossy: token agreement, not identity)
  hawk-colocated     HAWK's own engine, prefill and decode in one process (no transfer), with vLLM's step
                     budget (:data:`VLLM_CPU_STEP_TOKENS`)

For each prompt length, ``--repeats`` sequential greedy requests, each with another prompt (natural text
cut from :mod:`hawk.bench.prompt_text`, or ``--prompt-text random`` token ids; streamed;
``ignore_eos`` so every output has ``--max-tokens`` tokens): TTFT and TPOT as the client sees them, the KV transfer's time as
the decode side reports it (NixlConnector's ``vllm:nixl_xfer_time_seconds``, HawkConnector's pull time,
HAWK's ``kv_transfer_s``), and whether the text equals vllm-single's. P/D pairs are driven the way a P/D
router drives them (prefill with ``max_tokens: 1`` and ``do_remote_decode``, then the decode with the
prefill's ``kv_transfer_params``; each record's ``handoff_by``: ``client``, or ``hawk-router`` where HAWK's
router fronts a vLLM prefill and HAWK's decode), in one of two handoffs (each record's ``handoff``): ``standard`` (vLLM's:
the decode gets the original prompt, recomputes its last token and streams every output token; TTFT runs
from the prefill call to the decode's first token) or ``prompt+first-token`` (the decode gets the prompt
plus the prefill's first token and streams from the second; the client has the first token when the
prefill answers, which is its TTFT). ``decode_first_ms`` is the decode's first streamed token in both;
TPOT is the decode's own stream.
With ``--rates``, ``hawk bench serving`` then runs against each configuration's front door (vllm-router
in P/D mode for the vLLM pairs).

    python -m hawk.bench.vllm_pd --prompt-lens 32,256,1024 --repeats 3 --json benchmarks/results/vllm_pd_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from hawk.bench.prompt_text import natural_prompt
from hawk.integrations.vllm.handoff import Continue, after_prefill, prefill_request
from hawk.integrations.vllm.params import Handoff
from hawk.integrations.vllm.servers import VllmServer, free_port, hawk_transfer_config, inspect, nixl_transfer_config, stop_group

CONFIGS = ("vllm-single", "vllm-nixl", "vllm-nixl-paused", "hawk-gg-direct", "hawk-gn-hawk", "hawk-gn-hawk-bfp8", "hawk-colocated")
#: A folder whose sitecustomize.py makes NIXL's progress threads pause (vllm-nixl-paused's servers start with it first
#: on PYTHONPATH).
NIXL_PAUSE_DIR = Path(__file__).with_name("nixl_pause")
MODEL_NAME = "hawk-model"
#: ``--max-num-batched-tokens`` of hawk-colocated: vLLM's OpenAI server's default on a CPU, which the vLLM
#: servers here run with. A prompt longer than a step's budget is prefilled in chunks, and vLLM's CPU
#: attention kernel gives a later chunk's rows other last bits than one pass would
#: (:mod:`hawk.engine.vllm_cpu_kernel`): with HAWK's CPU default budget (640) a 1,024-token random-token prompt
#: parted from one vLLM instance at its first token for that reason alone.
VLLM_CPU_STEP_TOKENS = 2048


@dataclass
class Front:
    """How a configuration is asked: one OpenAI URL, or a P/D pair the client drives itself."""

    url: str  # the decode (P/D) or the one server
    prefill_url: str | None = None  # set for P/D pairs
    transfer_ms: Any = None  # () -> the last request's KV transfer time in ms, or None
    serving_url: str | None = None  # the front door for --rates (vllm-router for a P/D pair)
    handoff: Handoff | None = None  # how the decode continues the prefill (P/D pairs and HAWK's router)
    handoff_by: HandoffBy | None = None  # who carries the request from the prefill to the decode


class HandoffBy(enum.Enum):
    """Who takes a P/D request from the prefill's answer to the decode."""

    CLIENT = "client"  # this bench, the way a P/D router (vllm-router) drives the pair
    HAWK_ROUTER = "hawk-router"  # HAWK's router in front of a vLLM prefill and HAWK's decode


def stream_completion(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[str, list[float], dict[str, Any]]:
    """Text, each text chunk's arrival time, and the last chunk (usage, HAWK's summary)."""
    text, times, last = [], [], {}
    with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            piece = "".join(c.get("text") or "" for c in chunk.get("choices") or [])
            if piece:
                text.append(piece)
                times.append(time.perf_counter())
            last = chunk
    return "".join(text), times, last


def one_request(client: httpx.Client, front: Front, ids: list[int], max_tokens: int) -> dict[str, Any]:
    body = {"model": MODEL_NAME, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    first: list[float] = []  # the client's first token's arrival, when the prefill's answer is it
    step: Continue | None = None
    if front.handoff_by is HandoffBy.CLIENT and front.handoff is Handoff.PROMPT_PLUS_FIRST_TOKEN:
        r = client.post(f"{front.prefill_url}/v1/completions", json=prefill_request(body))
        r.raise_for_status()
        first.append(time.perf_counter())
        step = after_prefill(body, r.json())
        assert isinstance(step, Continue), "ignore_eos and max_tokens > 1: the prefill's first token cannot end the request"
        body = step.body
    elif front.handoff_by is HandoffBy.CLIENT:  # vLLM's standard P/D handoff
        r = client.post(f"{front.prefill_url}/v1/completions", json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        r.raise_for_status()
        body["kv_transfer_params"] = r.json()["kv_transfer_params"]
    text, times, last = stream_completion(client, front.url, body)
    n = (last.get("usage") or {}).get("completion_tokens") or len(times)  # the decode's own tokens
    if step is not None:
        text = step.text(text)
    hawk = last.get("hawk") or {}
    kv_ms = front.transfer_ms() if front.transfer_ms else (None if hawk.get("kv_transfer_s") is None else 1e3 * hawk["kv_transfer_s"])
    client_times = first + times
    return {
        "text": text,
        "ttft_ms": 1e3 * (client_times[0] - t0) if client_times else None,
        "decode_first_ms": 1e3 * (times[0] - t0) if times and front.prefill_url is not None else None,
        "tpot_ms": 1e3 * (times[-1] - times[0]) / (n - 1) if len(times) > 1 and n > 1 else None,
        "kv_transfer_ms": kv_ms,
    }


def nixl_xfer_ms(decode_url: str) -> Any:
    """The decode's NIXL transfer seconds so far, as a function returning the delta since its last call (ms)."""
    state = {"sum": _metric(decode_url, "vllm:nixl_xfer_time_seconds_sum")}

    def delta() -> float | None:
        now = _metric(decode_url, "vllm:nixl_xfer_time_seconds_sum")
        d, state["sum"] = now - state["sum"], now
        return 1e3 * d

    return delta


def _metric(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


def hawk_pull_ms(address: str) -> Any:
    def last() -> float | None:
        s = inspect(address).get("last_pull_s")
        return None if s is None else 1e3 * s

    return last


class Launcher:
    """Starts one configuration's processes and stops them all, whatever happens."""

    def __init__(self, model: str, logs: Path, threads: int | None):
        self.model, self.logs, self.threads = model, logs, threads
        self.servers: list[VllmServer] = []
        self.procs: list[subprocess.Popen] = []

    def vllm(self, name: str, **kw: Any) -> VllmServer:
        s = VllmServer(self.model, free_port(), served_name=MODEL_NAME, threads=self.threads, **kw)
        self.servers.append(s.start(self.logs / f"{name}.log"))
        return s

    def hawk(self, name: str, args: list[str]) -> str:
        port = free_port()
        env = {**os.environ, "UCX_NET_DEVICES": "lo"}
        with open(self.logs / f"{name}.log", "wb") as f:
            self.procs.append(subprocess.Popen([sys.executable, "-m", "hawk", "serve", *args, "--port", str(port)], env=env,
                                               stdout=f, stderr=subprocess.STDOUT, start_new_session=True))
        return f"http://127.0.0.1:{port}"

    def router(self, name: str, prefill: str, decode: str) -> str:
        exe = shutil.which("vllm-router")
        if exe is None:
            raise RuntimeError("vllm-router is not installed (pip install vllm-router)")
        port = free_port()
        with open(self.logs / f"{name}.log", "wb") as f:
            self.procs.append(subprocess.Popen([exe, "--vllm-pd-disaggregation", "--prefill", prefill, "--decode", decode,
                                                "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port())],
                                               stdout=f, stderr=subprocess.STDOUT,
                                               start_new_session=True))
        return f"http://127.0.0.1:{port}"

    def wait(self, *urls: str, timeout_s: float = 900.0) -> None:
        for s in self.servers:
            s.wait_ready(timeout_s)
        deadline = time.monotonic() + timeout_s
        for u in urls:
            while True:
                if any(p.poll() is not None for p in self.procs):
                    raise RuntimeError(f"a process of this configuration exited; logs in {self.logs}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{u}/health", timeout=2, trust_env=False).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{u} not healthy in time; logs in {self.logs}")
                time.sleep(0.5)

    def stop(self) -> None:
        for s in self.servers:
            s.stop()
        for p in self.procs:
            stop_group(p)


@contextlib.contextmanager
def launch(config: str, model: str, logs: Path, threads: int | None, gg_handoff: str = Handoff.PROMPT_PLUS_FIRST_TOKEN.value) -> Iterator[Front]:
    L = Launcher(model, logs, threads)
    extra = {"ttl_s": 60.0}
    try:
        if config == "vllm-single":
            s = L.vllm(config)
            L.wait()
            yield Front(s.url, serving_url=s.url)
        elif config in ("vllm-nixl", "vllm-nixl-paused", "hawk-gg-direct"):
            if config.startswith("vllm-nixl"):
                env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(NIXL_PAUSE_DIR), os.environ.get("PYTHONPATH")]))} if config.endswith("paused") else {}
                p = L.vllm(f"{config}-prefill", kv_transfer=nixl_transfer_config("kv_producer"),
                           extra_env={**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())})
                d = L.vllm(f"{config}-decode", kv_transfer=nixl_transfer_config("kv_consumer"), prefix_caching=False,
                           extra_env={**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())})
            else:
                ctl = free_port()
                p = L.vllm(f"{config}-prefill", kv_transfer=hawk_transfer_config("kv_producer", transfer="gg-direct", **extra))
                d = L.vllm(f"{config}-decode", kv_transfer=hawk_transfer_config("kv_consumer", transfer="gg-direct", port=ctl, **extra),
                           prefix_caching=False)
            L.wait()
            xfer = nixl_xfer_ms(d.url) if config.startswith("vllm-nixl") else hawk_pull_ms(f"tcp://127.0.0.1:{ctl}")
            front = L.router(f"{config}-router", p.url, d.url) if shutil.which("vllm-router") else None
            if front:
                L.wait(front)
            handoff = Handoff.STANDARD if config.startswith("vllm-nixl") else Handoff(gg_handoff)
            yield Front(d.url, prefill_url=p.url, transfer_ms=xfer, serving_url=front, handoff=handoff, handoff_by=HandoffBy.CLIENT)
        elif config.startswith("hawk-gn-hawk"):
            p = L.vllm(f"{config}-prefill", kv_transfer=hawk_transfer_config("kv_producer", transfer="gn-hawk", **extra))
            kv = ["--kv-dtype", "bfp8_b"] if config.endswith("bfp8") else []
            dec = L.hawk(f"{config}-decode", ["--role", "decode", "--model", model, "--dtype", "bf16", "--transfer", "gn-hawk",
                                               "--decode-device", "npu-emu:cpu", *kv, *(["--threads", str(threads)] if threads else [])])
            L.wait(dec)
            router = L.hawk(f"{config}-router", ["--role", "router", "--prefill-api", "vllm", "--prefill-url", p.url, "--decode-url", dec,
                                                 "--served-model-name", MODEL_NAME])
            L.wait(router)
            yield Front(router, serving_url=router, handoff=Handoff.PROMPT_PLUS_FIRST_TOKEN,  # HAWK's decode starts from the first token
                        handoff_by=HandoffBy.HAWK_ROUTER)
        elif config == "hawk-colocated":
            url = L.hawk(config, ["--transfer", "colocated", "--model", model, "--dtype", "bf16", "--served-model-name", MODEL_NAME,
                                  "--max-num-batched-tokens", str(VLLM_CPU_STEP_TOKENS),
                                  *(["--threads", str(threads), "--prompt-threads", str(threads)] if threads else [])])
            L.wait(url)
            yield Front(url, serving_url=url)
        else:
            raise ValueError(f"unknown configuration {config!r}; expected one of {CONFIGS}")
    finally:
        L.stop()


def random_prompt(n: int, seed: int) -> list[int]:
    """``n`` random ids of ordinary text tokens: the worst case for token identity (their greedy
    continuations are full of near-ties)."""
    return np.random.default_rng([seed, n]).integers(1000, 10000, n).tolist()


class Prompts:
    """The benchmark's prompts, the same for every configuration: ``natural`` (corpus text,
    :mod:`hawk.bench.prompt_text`, what users send) or ``random`` token ids (:func:`random_prompt`).
    Each (length, repeat) gets its own prompt, and the warm-up another, none a prefix of another."""

    def __init__(self, kind: str, model: str, lens: Sequence[int], repeats: int):
        if kind not in ("natural", "random"):
            raise ValueError(f"prompt text must be natural or random, got {kind!r}")
        self.kind, self.lens, self.repeats = kind, list(lens), repeats
        self._encode = None
        if kind == "natural":
            from hawk.engine.tokenizer import Tokenizer

            self._encode = Tokenizer.from_hf_dir(model).encode

    def __call__(self, n: int, rep: int) -> list[int]:
        if self._encode is None:
            return random_prompt(n, rep)
        slots = len(self.lens) * self.repeats + 1
        return natural_prompt(self._encode, n, self.lens.index(n) * self.repeats + rep, slots)

    def warmup(self) -> list[int]:
        if self._encode is None:
            return random_prompt(8, 99)
        return natural_prompt(self._encode, 8, len(self.lens) * self.repeats, len(self.lens) * self.repeats + 1)


def agreement(a: str, b: str) -> float:
    """Share of ``b``'s characters that ``a`` reproduces before the first difference."""
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return n / max(1, len(b))


def run(configs: Sequence[str], lens: Sequence[int], repeats: int, max_tokens: int, model: str, logs: Path,
        threads: int | None, rates: Sequence[str], num_requests: int, prompt_text: str = "natural",
        gg_handoff: str = Handoff.PROMPT_PLUS_FIRST_TOKEN.value) -> dict[str, Any]:
    prompts = Prompts(prompt_text, model, lens, repeats)
    records: list[dict[str, Any]] = []
    reference: dict[tuple[int, int], str] = {}
    serving: list[dict[str, Any]] = []
    order = ["vllm-single", *[c for c in configs if c != "vllm-single"]]  # the reference first
    for config in order:
        with launch(config, model, logs, threads, gg_handoff) as front, httpx.Client(timeout=600, trust_env=False) as client:
            one_request(client, front, prompts.warmup(), 4)  # warm-up: first plans, registrations, handshakes
            for n in lens:
                for rep in range(repeats):  # another prompt each time: no prefix-cache hit flatters a repeat
                    r = one_request(client, front, prompts(n, rep), max_tokens)
                    if config == "vllm-single":
                        reference[(n, rep)] = r["text"]
                    ref = reference.get((n, rep))
                    rec = {"config": config, "handoff": front.handoff and front.handoff.value,
                           "handoff_by": front.handoff_by and front.handoff_by.value, "prompt_tokens": n, "repeat": rep, "identical": r["text"] == ref,
                           "agreement": agreement(r["text"], ref or ""),
                           **{k: r[k] for k in ("ttft_ms", "decode_first_ms", "tpot_ms", "kv_transfer_ms")}}
                    records.append(rec)
                    print(json.dumps(rec), flush=True)
            if rates and front.serving_url:
                from hawk.bench.serving_cli import main as serving_main

                out = serving_main(["--url", front.serving_url, "--model", MODEL_NAME, "--rates", ",".join(rates), "--workload", "chatbot-tiny",
                                    "--num-requests", str(num_requests), "--config", config])
                serving.extend(out)
    if "vllm-single" not in configs:
        records = [r for r in records if r["config"] != "vllm-single"]
    return {"records": records, "serving": serving, "summary": summarize(records)}


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median per (config, prompt length), and TTFT against vllm-nixl's at that length."""
    out = []
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["config"], r["prompt_tokens"]), []).append(r)
    for (config, n), rs in groups.items():
        med = {k: _median([r.get(k) for r in rs]) for k in ("ttft_ms", "decode_first_ms", "tpot_ms", "kv_transfer_ms")}
        out.append({"config": config, "handoff": rs[0].get("handoff"), "handoff_by": rs[0].get("handoff_by"), "prompt_tokens": n, "identical": all(r["identical"] for r in rs),
                    "agreement": min(r["agreement"] for r in rs), **med})
    for anchor in ("vllm-nixl", "vllm-nixl-paused"):
        ttft = {s["prompt_tokens"]: s["ttft_ms"] for s in out if s["config"] == anchor}
        for s in out:
            if ttft.get(s["prompt_tokens"]) and s["ttft_ms"] is not None:
                s[f"ttft_vs_{anchor.replace('-', '_')}"] = s["ttft_ms"] / ttft[s["prompt_tokens"]]
    return out


def _median(xs: list[Any]) -> float | None:
    xs = [x for x in xs if x is not None]
    return float(np.median(xs)) if xs else None


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="hawk bench vllm-pd", description=__doc__.split("\n")[0].replace("``", ""))
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--prompt-lens", default="32,256,1024")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt-text", choices=("natural", "random"), default="natural",
                   help="prompts cut from HAWK's English corpus (default) or random token ids (near-ties' worst case)")
    p.add_argument("--gg-handoff", choices=[h.value for h in Handoff], default=Handoff.PROMPT_PLUS_FIRST_TOKEN.value,
                   help="how hawk-gg-direct's decode continues its prefill (vllm-nixl runs vLLM's standard handoff)")
    p.add_argument("--model", default=None, help="an HF model folder (default: the embedded SmolLM2 exported to bf16)")
    p.add_argument("--threads", type=int, default=None, help="threads per server (default: each server's own choice)")
    p.add_argument("--rates", default="", help="comma-separated request rates for hawk bench serving against each front (empty: skip)")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--logs", default=None, help="keep the servers' logs here")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    configs = [c.strip() for c in a.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        p.error(f"unknown configurations {bad}; expected some of {CONFIGS}")
    logs = Path(a.logs or tempfile.mkdtemp(prefix="hawk-vllm-pd-"))
    logs.mkdir(parents=True, exist_ok=True)
    model = a.model
    if model is None:
        import torch

        from hawk.engine.loader import load_model, save_hf_dir

        model = str(logs / "model")
        save_hf_dir(load_model("smollm2-135m", dtype=torch.bfloat16), model)
    t0 = time.time()
    out = run(configs, [int(x) for x in a.prompt_lens.split(",")], a.repeats, a.max_tokens, model, logs, a.threads,
              [r for r in a.rates.split(",") if r], a.num_requests, a.prompt_text, a.gg_handoff)
    out["settings"] = {**vars(a), "model": model, "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)),
                       "wall_s": time.time() - t0, "cpus": os.cpu_count(), "load_avg": os.getloadavg()}
    for s in out["summary"]:
        print(json.dumps(s))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
