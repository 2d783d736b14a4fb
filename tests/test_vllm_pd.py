"""HawkConnector in real vLLM servers (vllm-cpu): stock vLLM prefill -> HAWK's emulated-NPU decode
(gn-hawk, through HAWK's router) and stock vLLM -> stock vLLM (gg-direct), and HAWK's colocated engine,
each against one vLLM instance's own tokens; then success, client abort, a decode that never pulls and a dead prefill, each
checked from both sides: vLLM's own count of KV blocks in use, and HAWK's ledgers in every process.

One module-scoped cluster (three vLLM servers, a HAWK decode, a HAWK colocated engine and a HAWK router: about two minutes to
start on two cores); the prefill-death tests run last, as they kill the prefills.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (bash scripts/install.sh --with-vllm)", allow_module_level=True)

import torch  # noqa: E402

from hawk.bench.vllm_pd import VLLM_CPU_STEP_TOKENS, random_prompt  # noqa: E402
from hawk.engine.config import preset  # noqa: E402
from hawk.engine.vllm_cpu_kernel import kernel_isa  # noqa: E402
from hawk.integrations.vllm.handoff import Continue, Done, after_prefill, prefill_request  # noqa: E402
from hawk.integrations.vllm.params import read_handle  # noqa: E402
from hawk.integrations.vllm.servers import VllmServer, free_port, hawk_transfer_config, inspect, kv_cache_usage, stop_group  # noqa: E402
from hawk.transport.registry import available  # noqa: E402

pytestmark = pytest.mark.slow
TTL_S = 60.0  # HawkConnector's TTL here: the never-pulled tests wait it out. A first pull between two processes
# that never met (the router's warm-up) can take seconds on a loaded 2-core box: a 20 s TTL once expired before it
# (CI, 2026-12-04)
PULL_TIMEOUT_S = 30.0  # the decode's wait for each answer (a dead prefill's refused port ends it sooner; then vLLM recomputes)
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "Explain in detail how a transformer decoder generates text, token by token, "
    "and why a KV cache makes that faster. Mention attention, keys, values and positions. " * 3,
]
#: A prompt whose greedy path has near-ties. In vLLM's standard handoff a vLLM decode recomputes the last
#: prompt token over the pulled KV with its one-token kernel, where one instance ran a prefill: here the
#: first token flips ("\n" against end-of-text), with vLLM's own NixlConnector as with HawkConnector (the
#: prompt+first-token handoff computes what one instance does: test_..._prompt_plus_first_token_...). HAWK's
#: decode takes the prefill's first token, then computes the rest, its attention through vLLM's CPU kernel
#: (hawk/engine/vllm_cpu_kernel.py): one instance's tokens.
NEAR_TIES = "Write a haiku about the sea."
#: Random-token prompts, ``random_prompt(n, seed)``, on which HAWK's decode (32 tokens, seeds 1 and 2) and its
#: colocated engine (all five) part from one vLLM instance with HAWK's own fp32 CPU attention
#: (``HAWK_CPU_ATTENTION=torch``: the tests below fail so, on the AVX-512 box of docs/vllm.md): near-ties all along.
PARTED = [(32, 0), (32, 1), (32, 2), (256, 1), (1024, 2)]
#: Those prompts give one instance's tokens only where HAWK's CPU attention runs vLLM's kernel (SmolLM2's
#: head size, bf16; hawk/engine/vllm_cpu_kernel.py): where it cannot (vLLM's library not loadable, or AMX
#: tiles this process may not use), HAWK's torch attention parts from vLLM on near-ties by design.
FEEDS_VLLM_KERNEL = kernel_isa(preset("smollm2-135m").head_dim, torch.bfloat16) is not None
NOT_FED = "HAWK cannot run vLLM's CPU attention kernel here (kernel_isa is None): near-ties part by design"
MAX_TOKENS = 24
#: A random-token prompt (hawk.bench.vllm_pd.random_prompt(100, 6)) on which vLLM's standard handoff, vLLM
#: decode recomputing the last prompt token, parted from one instance at the 4th output token on the 2-core
#: box of docs/vllm.md (an AVX-512 CPU); the prompt+first-token handoff gave one instance's 24 tokens.
STANDARD_PARTS = random_prompt(100, 6)


def eventually(check: Callable[[], Any], what: str, timeout_s: float = 60.0) -> Any:
    """``check()``'s first truthy answer; fails with ``what`` and the last answer when time runs out."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            last = check()
            if last:
                return last
        except (httpx.HTTPError, RuntimeError) as e:
            last = e
        time.sleep(0.25)
    pytest.fail(f"{what}: still {last!r} after {timeout_s:.0f} s")


def hawk_proc(args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "UCX_NET_DEVICES": "lo"}
    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", "hawk", "serve", *args], env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait_http(url: str, proc: subprocess.Popen, log: Path, timeout_s: float = 400.0, peers: tuple[Path, ...] = ()) -> None:
    """Wait for ``url``'s health; a process that exits fails with its log's tail and its ``peers``' logs."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            others = "".join(f"\n--- {p.name}:\n{p.read_text()[-2000:]}" for p in peers if p.exists())
            pytest.fail(f"{url} exited with {proc.returncode}: {log.read_text()[-3000:]}{others}")
        try:
            if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    pytest.fail(f"{url} not healthy within {timeout_s:.0f} s: {log.read_text()[-3000:]}")


class Cluster:
    def __init__(self, root: Path):
        self.servers: list[VllmServer] = []
        self.procs: list[subprocess.Popen] = []
        try:
            self._start(root)
        except BaseException:  # a start that failed half-way must not leave servers behind
            self.close()
            raise

    def _start(self, root: Path) -> None:
        if not available("nixl"):
            pytest.skip("NIXL is not installed")
        import torch

        from hawk.engine.loader import load_model, save_hf_dir

        self.root = root
        self.address = {}  # server -> its worker's KV control address (learned from a handle)
        self.model = str(root / "model")
        save_hf_dir(load_model("smollm2-135m", dtype=torch.bfloat16), self.model)
        from hawk.engine.loader import load_hf_dir

        self.tokenizer = load_hf_dir(self.model).tokenizer
        extra = {"ttl_s": TTL_S, "staging_mb": 64, "pull_timeout_s": PULL_TIMEOUT_S}
        # P1: vLLM prefill for HAWK's NPU decode; P2: vLLM prefill for a vLLM decode, and the reference
        # (plain requests to it are a single vLLM instance); D: vLLM decode, no prefix caching (a local
        # hit would recompute instead of pulling).
        self.p1 = VllmServer(self.model, free_port(), kv_transfer=hawk_transfer_config("kv_producer", transfer="gn-hawk", **extra), threads=1)
        self.p2 = VllmServer(self.model, free_port(), kv_transfer=hawk_transfer_config("kv_producer", transfer="gg-direct", **extra), threads=1)
        self.d_port = free_port()
        self.d = VllmServer(self.model, free_port(), prefix_caching=False, threads=1,
                            kv_transfer=hawk_transfer_config("kv_consumer", transfer="gg-direct", port=self.d_port, **extra))
        self.servers.extend([self.p1, self.p2, self.d])
        for i, s in enumerate(self.servers):
            s.start(root / f"vllm{i}.log")
        self.p2_log, self.d_log = root / "vllm1.log", root / "vllm2.log"
        dec_port = free_port()
        self.dec_url = f"http://127.0.0.1:{dec_port}"
        self.dec = hawk_proc(["--role", "decode", "--model", self.model, "--dtype", "bf16", "--transfer", "gn-hawk",
                              "--decode-device", "npu-emu:cpu", "--port", str(dec_port), "--threads", "1", "--kv-tokens", "4096"],
                             root / "hawk-decode.log")
        self.procs.append(self.dec)
        # HAWK's colocated engine, prefill and decode its own, with the vLLM servers' step budget (a prompt
        # chunked otherwise gets other last bits from vLLM's CPU attention kernel: hawk/bench/vllm_pd.py) and
        # their one thread in prompt steps too (on an AMX CPU a long prompt's GEMMs round otherwise on two)
        colo_port = free_port()
        self.colo_url = f"http://127.0.0.1:{colo_port}"
        self.colo = hawk_proc(["--transfer", "colocated", "--model", self.model, "--dtype", "bf16", "--port", str(colo_port),
                               "--threads", "1", "--prompt-threads", "1", "--kv-tokens", "4096",
                               "--max-num-batched-tokens", str(VLLM_CPU_STEP_TOKENS), "--served-model-name", "hawk-model"],
                              root / "hawk-colocated.log")
        self.procs.append(self.colo)
        for i, s in enumerate(self.servers):
            s.wait_ready()
        for s in self.servers:  # each engine's first step (lazy kernel set-up) before any request is timed by a TTL
            self.complete(s, self.ids("A warm-up."), 2)
        self._first_contact()
        wait_http(self.dec_url, self.dec, root / "hawk-decode.log")
        wait_http(self.colo_url, self.colo, root / "hawk-colocated.log")
        # the router's port is picked as it starts: one picked minutes earlier, before the vLLM servers came up, was
        # taken meanwhile by one of their own ephemeral binds ("Address already in use", a fresh-clone CI run)
        self.router_port = free_port()
        self.router_url = f"http://127.0.0.1:{self.router_port}"
        self.router = hawk_proc(["--role", "router", "--prefill-api", "vllm", "--prefill-url", self.p1.url, "--decode-url", self.dec_url,
                                 "--port", str(self.router_port), "--served-model-name", self.p1.served_name], root / "hawk-router.log")
        self.procs.append(self.router)
        wait_http(self.router_url, self.router, root / "hawk-router.log", peers=(root / "hawk-decode.log",))
        # vllm-router in P/D mode in front of the vLLM prefill and HAWK's router as the decode front
        # (it sends the decode the prefill's kv_transfer_params, which carry HAWK's KV handle)
        self.pd_url = None
        exe = shutil.which("vllm-router")
        if exe is not None:
            port = free_port()
            with open(root / "vllm-router.log", "wb") as f:
                self.procs.append(subprocess.Popen([exe, "--vllm-pd-disaggregation", "--prefill", self.p1.url, "--decode", self.router_url,
                                                    "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port())],
                                                   stdout=f, stderr=subprocess.STDOUT, start_new_session=True))
            self.pd_url = f"http://127.0.0.1:{port}"
            wait_http(self.pd_url, self.procs[-1], root / "vllm-router.log")

    def _first_contact(self, attempts: int = 3) -> None:
        """P2 and D meet (their handshake, UCX's first connection) before any test counts D's pulls: on a
        loaded 2-core box the first hello once went unanswered for the decode's 30 s (CI, 2026-12-04). A
        pull that fails recomputes; the next attempt handshakes again."""
        ids = self.ids("A first contact.")
        for _ in range(attempts):
            before = self.pulls()
            self.complete(self.d, ids, 2, self.prefill(self.p2, ids))
            if self.pulls()["pulled"] > before["pulled"]:
                return
        pytest.fail(f"D never pulled from P2 in {attempts} attempts:\n{self.pull_errors()}")

    def close(self) -> None:
        for s in self.servers:
            s.stop()
        for p in self.procs:
            stop_group(p)

    def ids(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)

    def complete(self, server: VllmServer, ids: list[int], max_tokens: int, params: dict | None = None,
                 whole: bool = False) -> dict[str, Any]:
        """``whole``: the prompt prefilled in one pass whatever the server's prefix cache holds (a cache
        salt of its own), as one instance serving it first does."""
        body: dict[str, Any] = {"model": server.served_name, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
                                "return_token_ids": True}
        if params is not None:
            body["kv_transfer_params"] = params
        if whole:
            body["cache_salt"] = uuid.uuid4().hex
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()

    def prefill(self, server: VllmServer, ids: list[int]) -> dict[str, Any]:
        """What a P/D router does first: one token, the KV kept for the decode."""
        ans = self.complete(server, ids, 1, {"do_remote_decode": True})
        handle = read_handle(ans["kv_transfer_params"])
        assert handle is not None, ans
        self.address[server.port] = handle.address
        return ans["kv_transfer_params"]

    def reference(self, ids: list[int]) -> dict[str, Any]:
        """One instance's greedy tokens. Its prefill is whole: an earlier test's prefill of the same prompt
        on P2 would otherwise leave only the last token to compute, in a one-row step whose GEMMs round
        otherwise (on an AMX CPU a 1,024-token random prompt's answer changed so)."""
        return self.complete(self.p2, ids, MAX_TOKENS, whole=True)["choices"][0]

    def pulls(self) -> dict[str, Any]:
        """The vLLM decode worker's ledger (its ``pulled`` and ``pull_failures`` counts)."""
        return inspect(f"tcp://127.0.0.1:{self.d_port}")

    def pull_errors(self) -> str:
        """Why the vLLM decode's pulls failed, from its log (for a failing assertion's message)."""
        lines = self.d_log.read_text(errors="replace").splitlines()
        lines += self.p2_log.read_text(errors="replace").splitlines()  # the prefill's slow-handshake warnings
        return "\n".join(x for x in lines if "KVTransferFailed:" in x or "pulling its KV failed" in x or "hello from" in x)[-3000:]

    def assert_loaded(self, before: dict[str, Any], pulls: int = 1) -> None:
        """Since ``before``, the decode loaded ``pulls`` prompts and failed none (a failure would have
        been recomputed: same tokens, no transfer)."""
        now = self.pulls()
        got = (now["pulled"] - before["pulled"], now["pull_failures"] - before["pull_failures"])
        assert got == (pulls, 0), f"(pulled, failed) since: {got}; the decode's log says:\n{self.pull_errors()}"

    def idle(self, server: VllmServer) -> bool:
        """vLLM holds no KV block and HAWK nothing in that server's worker."""
        if kv_cache_usage(server.url) != 0.0:
            return False
        addr = self.address.get(server.port) or (f"tcp://127.0.0.1:{self.d_port}" if server is self.d else None)
        if addr is None:
            return True
        return ledger_empty(inspect(addr))

    def decode_idle(self) -> bool:
        a = httpx.get(f"{self.dec_url}/internal/accounting", timeout=5).json()
        return (a["kv_blocks_used"] == 0 and a["rx_reservations"] == 0 and a["draining"] == 0
                and a["engine_running"] == 0 and a["engine_waiting"] == 0 and a["engine_transferring"] == 0)


def ledger_empty(ledger: dict[str, Any]) -> bool:
    if ledger["held"] or ledger["unreported_sent"] or ledger["loading"] or ledger["unreported_loaded"]:
        return False
    s = ledger.get("sender")
    if s and (s["staging"] or s["waiting"] or s["in_flight"] or s["draining"]):
        return False
    r = ledger.get("receiver")
    return not (r and (r["reservations"] or r["draining"]))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("vllm-pd"))
    try:
        yield c
    finally:
        c.close()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_vllm_to_vllm_through_hawk_gives_one_instances_tokens(cluster, prompt):
    ids = cluster.ids(prompt)
    ref = cluster.reference(ids)
    before = cluster.pulls()
    params = cluster.prefill(cluster.p2, ids)
    out = cluster.complete(cluster.d, ids, MAX_TOKENS, params)["choices"][0]
    assert out["token_ids"] == ref["token_ids"], (out["text"], ref["text"])
    cluster.assert_loaded(before)  # the decode used the pulled KV, not a recompute
    eventually(lambda: cluster.idle(cluster.p2) and cluster.idle(cluster.d), "vLLM prefill and decode idle after success")


def exact_handoff(cluster: Cluster, ids: list[int], max_tokens: int, **extra: Any) -> tuple[Continue | Done, dict[str, Any]]:
    """The prompt+first-token handoff from P2 to D, as a router drives it: the step and the client's answer."""
    body = {"model": cluster.p2.served_name, "prompt": ids, "max_tokens": max_tokens, "temperature": 0, "return_token_ids": True, **extra}
    r = httpx.post(f"{cluster.p2.url}/v1/completions", json=prefill_request(body), timeout=300)
    assert r.status_code == 200, r.text
    step = after_prefill(body, r.json())
    if isinstance(step, Done):
        return step, step.answer
    cluster.address[cluster.p2.port] = step.handle.address
    d = httpx.post(f"{cluster.d.url}/v1/completions", json=step.body, timeout=300)
    assert d.status_code == 200, d.text
    assert d.json()["usage"]["prompt_tokens"] == len(ids) + 1  # the decode's prompt was the prompt plus the first token
    return step, step.answer(d.json())


@pytest.mark.parametrize("case", ["natural", "haiku", "near-tie", "127", "128", "129"])
def test_vllm_to_vllm_prompt_plus_first_token_gives_one_instances_tokens(cluster, case):
    """The decode loads the prompt's KV and computes only the first token, as one instance does after its
    prefill: one instance's tokens, also where the standard handoff parts, and for prompts ending one
    short of, at, and one past the CPU's 128-token block."""
    ids = {"natural": cluster.ids(PROMPTS[3]), "haiku": cluster.ids(NEAR_TIES), "near-tie": STANDARD_PARTS}.get(case) or random_prompt(int(case), 0)
    ref = cluster.complete(cluster.p1, ids, MAX_TOKENS, whole=True)["choices"][0]  # one instance, its prefill whole
    before = cluster.pulls()
    step, out = exact_handoff(cluster, ids, MAX_TOKENS)
    assert isinstance(step, Continue)
    (choice,) = out["choices"]
    assert choice["token_ids"] == ref["token_ids"] and choice["text"] == ref["text"], (choice["text"], ref["text"])
    assert out["usage"]["prompt_tokens"] == len(ids) and out["usage"]["completion_tokens"] == len(ref["token_ids"])
    cluster.assert_loaded(before)  # the decode loaded the prompt, not recomputed it
    eventually(lambda: cluster.idle(cluster.p2) and cluster.idle(cluster.d), "vLLM prefill and decode idle after the handoff")


def test_the_standard_handoff_parts_on_the_near_tie_prompt(cluster):
    """The control for the case above: the same pair in vLLM's standard handoff (the decode recomputes the
    last prompt token) parts from one instance on STANDARD_PARTS (measured on the AVX-512 development box).
    vLLM's CPU attention picks its kernel by the CPU's ISA; on a machine whose kernels round alike for
    this prompt the two handoffs agree on it, and the control says so as a skip rather than a failure."""
    ref = cluster.complete(cluster.p1, STANDARD_PARTS, MAX_TOKENS, whole=True)["choices"][0]
    before = cluster.pulls()
    params = cluster.prefill(cluster.p2, STANDARD_PARTS)
    out = cluster.complete(cluster.d, STANDARD_PARTS, MAX_TOKENS, params)["choices"][0]
    cluster.assert_loaded(before)  # it loaded the KV, then recomputed one token
    eventually(lambda: cluster.idle(cluster.p2) and cluster.idle(cluster.d), "vLLM prefill and decode idle after the handoff")
    if out["token_ids"] == ref["token_ids"]:
        pytest.skip("this CPU's vLLM kernels give one instance's tokens on STANDARD_PARTS in the standard handoff too: "
                    "the near-tie case above does not tell the handoffs apart here")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_vllm_prefill_to_hawk_npu_decode_gives_one_instances_tokens(cluster, prompt):
    ids = cluster.ids(prompt)
    ref = cluster.reference(ids)
    r = httpx.post(f"{cluster.router_url}/v1/completions", timeout=300,
                   json={"model": "hawk-model", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["text"] == ref["text"]
    assert body["hawk"]["kv_bytes"] > 0  # the decode pulled the prefill's KV (emulated NPU tiles)
    eventually(lambda: cluster.decode_idle() and kv_cache_usage(cluster.p1.url) == 0.0, "vLLM prefill and HAWK decode idle")


def hawk_text(url: str, prompt: str | list[int]) -> str:
    """A HAWK front's greedy completion of ``prompt`` (text or token ids), MAX_TOKENS long."""
    r = httpx.post(f"{url}/v1/completions", timeout=300,
                   json={"model": "hawk-model", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.skipif(not FEEDS_VLLM_KERNEL, reason=NOT_FED)
@pytest.mark.parametrize("case", ["haiku", *(f"random-{n}-{seed}" for n, seed in PARTED)])
def test_hawk_decode_gives_one_instances_tokens_on_near_ties(cluster, case):
    """vLLM prefill -> HAWK's emulated-NPU decode where near-ties fill the greedy path: HAWK's decode step
    makes vLLM's bits (its attention through vLLM's CPU kernel), so it gives one instance's tokens."""
    if case == "haiku":
        ids, prompt = cluster.ids(NEAR_TIES), NEAR_TIES
    else:
        n, seed = (int(x) for x in case.split("-")[1:])
        ids = prompt = random_prompt(n, seed)
    ref = cluster.reference(ids)
    assert hawk_text(cluster.router_url, prompt) == ref["text"]
    eventually(lambda: cluster.decode_idle() and kv_cache_usage(cluster.p1.url) == 0.0, "vLLM prefill and HAWK decode idle")


@pytest.mark.skipif(not FEEDS_VLLM_KERNEL, reason=NOT_FED)
@pytest.mark.parametrize("n,seed", PARTED)
def test_hawk_colocated_gives_one_instances_tokens_on_near_ties(cluster, n, seed):
    """HAWK's colocated engine, its prefill its own too, gives one vLLM instance's tokens where near-ties
    fill the greedy path (a 1,024-token prompt too: one step, as vLLM prefills it)."""
    ids = random_prompt(n, seed)
    assert hawk_text(cluster.colo_url, ids) == cluster.reference(ids)["text"]


def test_hawk_decode_starts_from_the_prefills_first_token(cluster):
    """The prefill samples one instance's first token, and HAWK's decode answers with it (the KV handle
    handed to HAWK's router as a P/D router hands it, so the held KV is pulled, not left to the TTL)."""
    ids = cluster.ids(NEAR_TIES)
    ref = cluster.reference(ids)
    params = cluster.prefill(cluster.p1, ids)
    assert read_handle(params).first_token == ref["token_ids"][0]  # the prefill sampled what one instance samples
    r = httpx.post(f"{cluster.router_url}/v1/completions", timeout=300,
                   json={"model": "hawk-model", "prompt": NEAR_TIES, "max_tokens": 1, "temperature": 0, "kv_transfer_params": params})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == cluster.tokenizer.decode([ref["token_ids"][0]])
    assert r.json()["hawk"]["kv_bytes"] > 0  # the decode pulled the handed KV
    eventually(lambda: cluster.decode_idle() and kv_cache_usage(cluster.p1.url) == 0.0, "vLLM prefill and HAWK decode idle")


def test_openai_client_through_vllm_router_to_hawk_decode(cluster):
    """A stock P/D router (vllm-router) fronting the vLLM prefill and HAWK's router as the decode."""
    openai = pytest.importorskip("openai")
    if cluster.pd_url is None:
        pytest.skip("vllm-router is not installed (bash scripts/install.sh --with-vllm)")
    ref = cluster.reference(cluster.ids(PROMPTS[1]))
    client = openai.OpenAI(base_url=f"{cluster.pd_url}/v1", api_key="none", max_retries=0)
    r = client.completions.create(model=cluster.p1.served_name, prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0)
    assert r.choices[0].text == ref["text"]
    assert r.model_extra["hawk"]["kv_bytes"] > 0  # HAWK's decode pulled the KV vLLM prefilled
    eventually(lambda: cluster.decode_idle() and kv_cache_usage(cluster.p1.url) == 0.0, "idle after the routed request")


def test_client_abort_releases_both_sides(cluster):
    with httpx.stream("POST", f"{cluster.router_url}/v1/completions", timeout=300,
                      json={"model": "hawk-model", "prompt": PROMPTS[3], "max_tokens": 400, "temperature": 0, "stream": True,
                            "ignore_eos": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # the first tokens are out: the request is decoding; leave
    eventually(lambda: cluster.decode_idle(), "HAWK decode idle after the client left")
    eventually(lambda: kv_cache_usage(cluster.p1.url) == 0.0, "vLLM prefill's blocks back after the client left")


def test_kv_nobody_pulls_goes_back_to_vllm_at_the_ttl(cluster):
    """KV that nobody will pull comes back to vLLM when HAWK's TTL passes, both cases waiting out one TTL:
    a decode that dies before pulling (P1), and a first token whose text matches a stop string (P2): the
    prefill's answer is the whole answer, but vLLM matches stop strings in its front end, after its engine
    finished the one-token request by length, so HawkConnector was told of a length-capped request and holds
    its KV."""
    ids = cluster.ids(NEAR_TIES)
    first = cluster.complete(cluster.p1, ids, 1)["choices"][0]
    step, out = exact_handoff(cluster, ids, MAX_TOKENS, stop=[first["text"][-1]])
    assert isinstance(step, Done) and out["choices"][0]["finish_reason"] == "stop"
    stopped = read_handle(out["kv_transfer_params"])
    assert stopped is not None and kv_cache_usage(cluster.p2.url) > 0.0
    cluster.address[cluster.p2.port] = stopped.address
    params = cluster.prefill(cluster.p1, cluster.ids(PROMPTS[2]))
    held = inspect(read_handle(params).address)
    assert held["sender"]["waiting"] and kv_cache_usage(cluster.p1.url) > 0.0  # held for the pull
    for s in (cluster.p1, cluster.p2):  # while vLLM holds KV its engine steps back to back (docs/vllm.md): for the
        # TTL that is some 2.6 of this box's 2 cores, which the other pytest worker's timed tests must not wait behind
        # (both prefills are killed by the tests after this one)
        os.setpriority(os.PRIO_PGRP, s.proc.pid, 19)
    eventually(lambda: cluster.idle(cluster.p1) and cluster.idle(cluster.p2), "vLLM prefills idle after the TTL", timeout_s=TTL_S + 30)


def test_dead_prefill_fails_the_hawk_decodes_request_and_it_releases(cluster):
    from hawk.serve.contract import DecodeRequest, KVRef

    params = cluster.prefill(cluster.p1, cluster.ids(PROMPTS[1]))
    h = read_handle(params)
    cluster.p1.stop(kill=True)
    body = DecodeRequest.of(request_id="dead-prefill", prompt_len=h.num_tokens, first_token=h.first_token,
                            params={"max_tokens": 8, "temperature": 0.0}, kv=KVRef(address=h.address, request_id=h.request_id))
    t0 = time.monotonic()
    with httpx.stream("POST", f"{cluster.dec_url}/internal/decode", content=body.model_dump_json(), timeout=120,
                      headers={"content-type": "application/json"}) as r:
        lines = [json.loads(x) for x in r.iter_lines() if x]
    assert r.status_code != 200 or lines[-1]["finish_reason"] == "error", lines
    assert time.monotonic() - t0 < PULL_TIMEOUT_S / 2  # the dead prefill's port refused: no wait for the timeout
    eventually(lambda: cluster.decode_idle(), "HAWK decode idle after its prefill died")


def test_dead_prefill_makes_the_vllm_decode_recompute_and_release(cluster):
    ids = cluster.ids(PROMPTS[0])
    ref = cluster.reference(ids)
    params = cluster.prefill(cluster.p2, ids)
    before = cluster.pulls()
    cluster.p2.stop(kill=True)
    t0 = time.monotonic()
    out = cluster.complete(cluster.d, ids, MAX_TOKENS, params)["choices"][0]
    assert time.monotonic() - t0 < PULL_TIMEOUT_S / 2  # the dead prefill's port refused: no wait for the timeout
    assert out["token_ids"] == ref["token_ids"]  # vLLM recomputed the blocks HAWK could not load
    assert cluster.pulls()["pull_failures"] == before["pull_failures"] + 1
    eventually(lambda: cluster.idle(cluster.d), "vLLM decode idle after its prefill died")
