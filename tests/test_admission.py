"""Decode admission under memory pressure: by current need, preemption by swap, back-pressure, no leaks.

Each test here failed on the engine that reserved prompt + max_tokens blocks up front and admitted
strictly in order: a long request held every block, the short ones behind it waited for it to end,
and a prefilled request waiting longer than the prefill's TTL came back as an error.
"""

import json
import threading
import time
from dataclasses import replace

import pytest
import torch

from hawk.engine.decode_engine import KVHandle, LocalKV, TokenEvent
from hawk.engine.instances import ColocatedInstance, DecodeInstance, InstanceConfig, PrefillInstance
from hawk.engine.sequence import SamplingParams, Status
from tests.polling import wait_until

BASE = InstanceConfig(model="tiny", transport="local", kv_tokens=512, staging_mb=8, rx_mb=8)


class Collector:
    def __init__(self):
        self.tokens, self.done, self.info = [], threading.Event(), {}
        self.finished_at = None

    def __call__(self, ev: TokenEvent):
        if ev.token is not None:
            self.tokens.append(ev.token)
        self.info.update(ev.info)
        if ev.finish_reason:
            self.info["finish_reason"], self.info["error"] = ev.finish_reason, ev.error
            self.finished_at = time.monotonic()
            self.done.set()


class Pair:
    """A prefill and a decode instance of one transfer configuration, or the colocated oracle."""

    def __init__(self, transfer: str, decode_tokens: int = 512, ttl_s: float = 30.0, loaded=None, base=BASE):
        self.transfer = transfer
        if transfer == "colocated":
            self.c = ColocatedInstance(replace(base, transfer="colocated", kv_tokens=decode_tokens), loaded=loaded)
            self.engine, self.blocks, self.loaded = self.c.decode, self.c.blocks, self.c.loaded
            return
        device = "npu-emu:cpu" if transfer.startswith("gn") else "cpu"
        cfg = replace(base, transfer=transfer, decode_device=device, kv_tokens=decode_tokens, kv_ttl_s=ttl_s)
        self.p = PrefillInstance(replace(cfg, kv_tokens=4096), loaded=loaded)
        self.d = DecodeInstance(cfg, loaded=self.p.loaded)
        self.engine, self.blocks, self.loaded = self.d.engine, self.d.blocks, self.p.loaded

    def submit(self, rid, prompt, params, col=None):
        col = col or Collector()
        if self.transfer == "colocated":
            r = self.c.prefill.submit(rid, prompt, params).result(60)
            self.engine.submit(rid, r.num_prompt_tokens, r.first_token, params, self.c.take_blocks(rid), col)
        else:
            r = self.p.engine.submit(rid, prompt, params).result(60)
            self.engine.submit(rid, r.num_prompt_tokens, r.first_token, params, KVHandle(self.p.kv_address, rid), col)
        return col

    def blocks_back(self, timeout=5.0) -> bool:
        deadline = time.monotonic() + timeout
        while self.blocks.num_free != self.blocks.num_blocks and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.blocks.num_free == self.blocks.num_blocks and not self.blocks.owners()

    def close(self):
        if self.transfer == "colocated":
            self.c.close()
        else:
            self.p.close()
            self.d.close()


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def pairs(request):
    """``async``: the decode engines overlap their steps (a GPU's default) here too, so preemption,
    swap and abort run beside a step in flight."""
    torch.set_num_threads(1)
    base = replace(BASE, async_scheduling=request.param)
    gn = Pair("gn-hawk", base=base)  # 8 NPU blocks of 64 tokens
    out = {"gn-hawk": gn, "gg-direct": Pair("gg-direct", loaded=gn.loaded, base=base),
           "colocated": Pair("colocated", decode_tokens=1024, loaded=gn.loaded, base=base)}
    yield out
    for p in out.values():
        p.close()


def _prompt(i: int, n: int) -> list[int]:
    return [(13 * i + 7 * j) % 250 + 1 for j in range(n)]


# ---- no head-of-line blocking ---------------------------------------------------------------


def test_a_pool_filling_request_does_not_delay_short_ones(pairs):
    """A request whose max_tokens fills the whole KV pool, then 4 short ones: the short ones run beside
    it (admitted by their prompt's block) and finish within their own time + 10 s, long before it."""
    pr = pairs["gn-hawk"]
    short = SamplingParams(max_tokens=8, ignore_eos=True)
    t0 = time.monotonic()
    alone = pr.submit("alone", _prompt(99, 20), short)
    assert alone.done.wait(60)
    own_s = time.monotonic() - t0
    # 20 + 490 tokens = all 8 blocks: up front, the old engine gave this request every block
    long = pr.submit("long", _prompt(0, 20), SamplingParams(max_tokens=490, ignore_eos=True))
    while len(long.tokens) < 2:
        time.sleep(0.002)
    t0 = time.monotonic()
    shorts = [pr.submit(f"short{i}", _prompt(i + 1, 10 + i), short) for i in range(4)]
    for col in shorts:
        assert col.done.wait(60) and col.info["finish_reason"] == "length" and len(col.tokens) == 8
        assert col.finished_at - t0 <= own_s + 10.0
    assert long.done.wait(120) and len(long.tokens) == 490
    assert all(col.finished_at < long.finished_at for col in shorts), "the short requests waited for the long one"
    assert pr.blocks_back()


# ---- preemption by swap ---------------------------------------------------------------------


def _force_one_preemption(engine, blocks, at_step: int, squat: int):
    """Preempt the (only) running request after ``at_step`` steps, and squat on the blocks it frees so
    that it resumes in other blocks: the swap must really move its KV. Returns the squatted blocks
    and a function that puts the engine's own methods back.

    Overlapped steps reserve their blocks in ``_reserve_ahead``; at ``at_step`` it reports a dry pool,
    as it would when the next step needs a preemption, so the engine drains and preempts as a
    synchronous loop does."""
    real, real_ahead = engine._reserve_next_slots, engine._reserve_ahead
    state = {"steps": 0, "squatted": []}

    def hooked():
        state["steps"] += 1
        if state["steps"] == at_step and engine._running:
            engine._preempt(engine._running[-1])
            state["squatted"] = blocks.allocate(squat, "squatter")
        real()

    def hooked_ahead(batch):
        if state["steps"] + 1 == at_step:
            return False
        state["steps"] += 1
        return real_ahead(batch)

    def restore():
        engine._reserve_next_slots, engine._reserve_ahead = real, real_ahead

    engine._reserve_next_slots, engine._reserve_ahead = hooked, hooked_ahead
    return state, restore


@pytest.mark.parametrize("transfer", ["gn-hawk", "gg-direct", "colocated"])
def test_preemption_by_swap_gives_the_same_tokens(pairs, transfer):
    pr = pairs[transfer]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    prompt = _prompt(5, 90)  # crosses a block boundary on every path
    ref = pr.submit("ref", prompt, params)
    assert ref.done.wait(60) and len(ref.tokens) == 40
    before = pr.engine.stats()["preemptions"]
    state, restore = _force_one_preemption(pr.engine, pr.blocks, at_step=17, squat=3)
    try:
        col = pr.submit("swapped", prompt, params)
        assert col.done.wait(60), "the preempted request never finished"
    finally:
        restore()
    pr.blocks.free(state["squatted"])
    assert state["squatted"], "the preemption hook never ran"
    assert pr.engine.stats()["preemptions"] == before + 1 and col.info.get("preemptions") == 1
    assert col.tokens == ref.tokens
    assert pr.blocks_back()


def test_pool_pressure_preempts_newest_and_every_request_finishes(pairs):
    """Requests that outgrow the pool together: the newest are swapped out and resumed, all finish,
    and every block comes back."""
    pr = pairs["gn-hawk"]
    params = SamplingParams(max_tokens=120, ignore_eos=True)
    before = pr.engine.stats()["preemptions"]
    cols = [pr.submit(f"grow{i}", _prompt(i, 40), params) for i in range(6)]  # 6 x 1 block -> 6 x 3 blocks > 8
    for col in cols:
        assert col.done.wait(120) and col.info["finish_reason"] == "length" and len(col.tokens) == 120
    assert pr.engine.stats()["preemptions"] > before
    assert pr.blocks_back()


# ---- every reservation released -------------------------------------------------------------


def test_abort_while_swapped_or_waiting_frees_everything(pairs):
    pr = pairs["gn-hawk"]
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    state, restore = _force_one_preemption(pr.engine, pr.blocks, at_step=5, squat=pr.blocks.num_blocks)
    try:
        col = pr.submit("to-swap", _prompt(1, 30), params)
        deadline = time.monotonic() + 30
        while not state["squatted"] and time.monotonic() < deadline:
            time.sleep(0.005)
        assert pr.engine.stats()["swapped"] == 1  # the squatter leaves it no room to resume
        waiter = pr.submit("waiter", _prompt(2, 30), params)  # queued behind it, holding nothing
        assert pr.engine.abort("to-swap") and pr.engine.abort("waiter")
        assert col.done.wait(10) and col.info["finish_reason"] == "abort"
        assert waiter.done.wait(10) and waiter.info["finish_reason"] == "abort"
        assert pr.engine.stats()["swapped"] == 0 and pr.engine.stats()["waiting"] == 0
    finally:
        restore()
        pr.blocks.free(state["squatted"])
    assert pr.blocks_back() and not pr.engine._generators


def test_colocated_abort_while_queued_gives_back_the_prefill_blocks(pairs):
    """Colocated, a queued request holds the prefill's blocks through its handle: an abort frees them."""
    pr = pairs["colocated"]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    r = pr.c.prefill.submit("held", _prompt(7, 32), params).result(60)  # 2 full blocks: the first step needs a 3rd
    squatter = pr.blocks.allocate(pr.blocks.num_free, "squatter")
    col = Collector()
    pr.engine.submit("held", r.num_prompt_tokens, r.first_token, params, pr.c.take_blocks("held"), col)
    time.sleep(0.2)
    assert pr.engine.stats()["waiting"] == 1
    assert pr.engine.abort("held") and col.done.wait(5) and col.info["finish_reason"] == "abort"
    pr.blocks.free(squatter)
    assert pr.blocks_back()


def test_colocated_first_token_goes_out_at_submit_before_admission(pairs):
    """Colocated, the prefill's token is streamed as the request is submitted, not after the step in
    flight (and the next one): here it comes while the request cannot be admitted at all; the
    admission's info arrives with the second token, and the tokens are those of an unhindered run."""
    pr = pairs["colocated"]
    assert pr.engine.kv.kv_here and not LocalKV(None).kv_here  # a CPU engine's; a GPU's keeps the transfer thread's path
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    ref = pr.submit("ref-early", _prompt(9, 32), params)
    assert ref.done.wait(30)
    r = pr.c.prefill.submit("early", _prompt(9, 32), params).result(60)
    squatter = pr.blocks.allocate(pr.blocks.num_free, "squatter")
    col = Collector()
    try:
        pr.engine.submit("early", r.num_prompt_tokens, r.first_token, params, pr.c.take_blocks("early"), col)
        assert col.tokens == [r.first_token] and "decode_first_token_s" in col.info
        time.sleep(0.2)
        assert pr.engine.stats()["waiting"] == 1 and col.tokens == [r.first_token]
    finally:
        pr.blocks.free(squatter)
    assert col.done.wait(30) and col.info["finish_reason"] == "length"
    assert col.tokens == ref.tokens and col.info["kv_mode"] == "colocated"
    assert pr.blocks_back()


def test_colocated_first_token_that_ends_the_request_is_not_sent_early(pairs):
    """max_tokens=1: the one token also finishes the request, which the engine thread does as before."""
    pr = pairs["colocated"]
    col = pr.submit("one", _prompt(3, 20), SamplingParams(max_tokens=1, ignore_eos=True))
    assert col.done.wait(30) and len(col.tokens) == 1 and col.info["finish_reason"] == "length"
    assert pr.blocks_back()


def test_a_failing_swap_in_fails_that_request_and_frees_its_blocks(pairs, monkeypatch):
    pr = pairs["gg-direct"]
    params = SamplingParams(max_tokens=60, ignore_eos=True)

    def broken(kv, block_ids):
        raise RuntimeError("host copy lost")

    monkeypatch.setattr(pr.engine.swapper, "swap_in", broken)
    state, restore = _force_one_preemption(pr.engine, pr.blocks, at_step=5, squat=0)
    try:
        col = pr.submit("doomed", _prompt(3, 30), params)
        assert col.done.wait(30) and col.info["finish_reason"] == "error" and "host copy lost" in col.info["error"]
    finally:
        restore()
    monkeypatch.undo()
    assert pr.blocks_back()
    ok = pr.submit("after-broken-swap", _prompt(3, 30), SamplingParams(max_tokens=5, ignore_eos=True))
    assert ok.done.wait(30) and len(ok.tokens) == 5


def test_close_with_swapped_and_waiting_requests_frees_every_block():
    pr = Pair("gn-hawk")
    try:
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        state, _ = _force_one_preemption(pr.engine, pr.blocks, at_step=5, squat=pr.blocks.num_blocks)
        pr.submit("swap-at-close", _prompt(1, 30), params)
        deadline = time.monotonic() + 30
        while not state["squatted"] and time.monotonic() < deadline:
            time.sleep(0.005)
        pr.submit("wait-at-close", _prompt(2, 30), params)
        assert pr.engine.stats()["swapped"] == 1
        pr.engine.close()
        pr.blocks.free(state["squatted"])
        assert pr.blocks_back(timeout=0)
    finally:
        pr.close()


# ---- back-pressure, not expiry --------------------------------------------------------------


# Short enough that the waits below outlive it, long enough that a loaded 2-core CI box (the other
# xdist worker running vLLM servers) does not delay a keep-alive past it: they go out every TTL/4 and
# extend to one TTL, and 2 s (1.5 s of slack) was once overrun.
TTL_S = 4.0


def _connected_pair(ttl_s: float) -> Pair:
    """A gn-hawk pair whose decode has already pulled once: the handshake (seconds on a loaded box)
    is over, so what follows measures keep-alive, not the first contact."""
    pr = Pair("gn-hawk", ttl_s=ttl_s)
    col = pr.submit("hello", _prompt(9, 20), SamplingParams(max_tokens=2, ignore_eos=True))
    assert col.done.wait(60) and col.info["finish_reason"] == "length", col.info
    assert pr.blocks_back()
    return pr


class _KeepAlives:
    """When the decode sent keep-alives and the prefill took them, for a failing assertion's message
    (CI has lost a queued request's KV to its TTL twice; this says which side was late)."""

    def __init__(self, pr: Pair, monkeypatch) -> None:
        self.t0, self.sent, self.taken = time.monotonic(), [], []
        self.sender = pr.p.sender
        receiver, sender = pr.d.rank.receiver, pr.p.sender
        send, take = receiver.keep_alive, sender._keep_alive

        def sent(address, ids):
            out = send(address, ids)
            self.sent.append((round(time.monotonic() - self.t0, 2), list(ids), out))
            return out

        def taken(msg):
            self.taken.append((round(time.monotonic() - self.t0, 2), list(msg.request_ids)))
            return take(msg)

        monkeypatch.setattr(receiver, "keep_alive", sent)
        monkeypatch.setattr(sender, "_keep_alive", taken)

    def why(self, rid: str) -> str:
        with self.sender._lock:
            gone = self.sender._gone.get(rid)
        fate = "held" if gone is None else f"{gone[0]} at {gone[1] - self.t0:.2f} s"
        return f"prefill: {fate}; decode sent (s, ids, went out): {self.sent}; prefill took (s, ids): {self.taken}"


def test_a_request_queued_past_the_prefill_ttl_is_still_served(monkeypatch):
    """The decode is memory-bound for 2.5 TTLs; the queued request's KV is kept alive, not expired."""
    pr = _connected_pair(ttl_s=TTL_S)
    try:
        seen = _KeepAlives(pr, monkeypatch)
        squatter = pr.blocks.allocate(pr.blocks.num_blocks, "squatter")  # the decode's memory is all taken
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        col = pr.submit("patient", _prompt(4, 50), params)
        time.sleep(2.5 * TTL_S)
        assert not col.done.is_set() and pr.engine.stats()["waiting"] == 1
        assert pr.p.accounting()["kv_waiting"] == ["patient"], seen.why("patient")  # still held by the prefill
        pr.blocks.free(squatter)
        assert col.done.wait(30)
        assert col.info["finish_reason"] == "length" and len(col.tokens) == 6, col.info
        assert pr.blocks_back()
        time.sleep(0.3)
        assert pr.p.accounting()["gpu_blocks_used"] == 0 and pr.p.accounting()["staging_reservations"] == 0
    finally:
        pr.close()


def test_an_aborted_queued_request_still_expires_on_the_prefill(monkeypatch):
    """Keep-alive lasts only while the decode has the request queued: once aborted, the TTL frees it."""
    pr = _connected_pair(ttl_s=TTL_S)
    try:
        seen = _KeepAlives(pr, monkeypatch)
        squatter = pr.blocks.allocate(pr.blocks.num_blocks, "squatter")
        col = pr.submit("gives-up", _prompt(6, 50), SamplingParams(max_tokens=6, ignore_eos=True))
        time.sleep(2 * TTL_S)
        assert pr.p.accounting()["kv_waiting"] == ["gives-up"], seen.why("gives-up")
        assert pr.engine.abort("gives-up") and col.done.wait(5)
        # the TTL runs from the last keep-alive; a reaper that wakes late on a loaded box moves the
        # deadline by its stall (algorithm1.STALL_S), so allow for that too
        def released() -> bool:
            acc = pr.p.accounting()
            return acc["kv_waiting"] == [] and acc["gpu_blocks_used"] == 0

        wait_until(released, TTL_S + 15, lambda: f"the aborted request's KV is still held: {pr.p.accounting()}")
        pr.blocks.free(squatter)
        assert pr.blocks_back()
    finally:
        pr.close()


def test_status_enum_has_the_swapped_state():
    assert Status.SWAPPED.value == "swapped"


# ---- over HTTP: the reported case, through the serving stack on loopback --------------------


@pytest.mark.slow
def test_over_http_a_pool_filling_completion_does_not_starve_short_chats():
    """``hawk serve``'s apps (router, prefill, decode; NIXL on loopback when installed) with a decode
    pool of 8 NPU blocks: one streamed completion whose max_tokens fills the pool, then 4 short
    chats. Before, the chats waited behind it (and got 500s once their KV expired).

    Nothing here depends on how fast the box is: the property is an order, not a duration (each chat
    answered 200 while the long completion was still generating; it needs 480 decode steps, a chat
    8, on the same decode, so a loaded box slows both alike), the KV TTL is far beyond any wait here,
    and the test closes the long completion once the chats have answered. Timeouts only bound a hang."""
    pytest.importorskip("gguf")
    import httpx

    from hawk.engine.loader import embedded_path
    from hawk.serve.common import ThreadedServer
    from hawk.serve.decode_server import create_decode_app
    from hawk.serve.prefill_server import create_prefill_app
    from hawk.serve.router import RouterConfig, create_router_app
    from hawk.transport.registry import available

    try:
        embedded_path()
    except ValueError as e:
        pytest.skip(str(e))
    transport = "nixl" if available("nixl") else "local"
    cfg = InstanceConfig(model="smollm2-135m", transport=transport, kv_tokens=512, staging_mb=16, rx_mb=16, kv_ttl_s=120.0)
    prefill = PrefillInstance(replace(cfg, kv_tokens=2048))
    decode = DecodeInstance(cfg, loaded=prefill.loaded)
    servers = [ThreadedServer(create_prefill_app(prefill)).start(), ThreadedServer(create_decode_app(decode)).start()]
    servers.append(ThreadedServer(create_router_app(RouterConfig([servers[0].url], [servers[1].url], default_temperature=0.0))).start())
    chat = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "ignore_eos": True}
    long_body = {"prompt": "Count to a thousand:", "max_tokens": 480, "ignore_eos": True, "stream": True}
    hang_s = 900.0  # bounds a hang only: a passing run never comes near it
    long_open, long_finished, stop_long = threading.Event(), threading.Event(), threading.Event()
    results: dict[str, tuple[int, bool]] = {}  # name -> (status, the long completion was still generating)
    try:
        with httpx.Client(base_url=servers[2].url, timeout=hang_s, trust_env=False) as http:
            assert http.post("/v1/chat/completions", json=chat).status_code == 200

            def run_long() -> None:
                """Read the long completion's stream until it ends or the test has its answers."""
                try:
                    with http.stream("POST", "/v1/completions", json=long_body) as r:
                        results["long"] = (r.status_code, True)
                        for line in r.iter_lines():
                            if line.startswith("data: {"):
                                long_open.set()
                                if json.loads(line[6:])["choices"][0]["finish_reason"] is not None:
                                    long_finished.set()
                            if stop_long.is_set():
                                break  # leaving the block closes the stream: the decode aborts it
                finally:
                    long_open.set()

            def short(name: str) -> None:
                r = http.post("/v1/chat/completions", json=chat)
                results[name] = (r.status_code, not long_finished.is_set())

            reader = threading.Thread(target=run_long)
            reader.start()
            assert long_open.wait(hang_s) and results["long"][0] == 200, results
            shorts = [threading.Thread(target=short, args=(f"short{i}",)) for i in range(4)]
            for t in shorts:
                t.start()
            for t in shorts:
                t.join(hang_s)
            stop_long.set()
            reader.join(hang_s)
        assert all(results[f"short{i}"][0] == 200 for i in range(4)), results
        assert all(results[f"short{i}"][1] for i in range(4)), f"a short chat waited for the long completion: {results}"
        deadline = time.monotonic() + hang_s
        while decode.blocks.num_free != decode.blocks.num_blocks:  # the aborted long completion gives its blocks back
            assert time.monotonic() < deadline, "the decode kept blocks after the long completion was closed"
            time.sleep(0.05)
    finally:
        for s in reversed(servers):
            s.stop()
