"""Timing emulation (--npu-timing, --link-gbps): the pacing math, that it is off when off, its
labels, and the simulator's known answers for a paced configuration."""

import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from hawk import config
from hawk.devices import timing
from hawk.devices.emulated import EmulatedNpu
from hawk.devices.timing import (
    P150A,
    DramCopyModel,
    StepModel,
    engine_step_model,
    link_time_s,
    p150a_step_model,
    pace_until,
    timing_label,
)
from hawk.layouts.npu import get_arch
from hawk.plan.requests import Copy
from hawk.transport.base import TransferHandle
from hawk.transport.local import LocalTransport
from hawk.transport.paced import PacedTransport, paced

# ---- the models --------------------------------------------------------------------------------


def test_p150a_step_model_reproduces_tenstorrents_8b_figures():
    m = p150a_step_model(P150A.llama_8b_params, 0.0)
    assert m.step_time(1, 0) == pytest.approx(1 / 33.6)
    assert m.step_time(32, 0) == pytest.approx(1 / 29.0)
    assert p150a_step_model(1e9, 512.0).per_ctx_token_s == pytest.approx(1e-9)  # 512 B at 512 GB/s


def test_the_simulators_p150a_model_is_the_engines():
    from hawk.sim.testbeds import PaperFacts, p150a_decode

    f = PaperFacts()
    assert (f.p150a_8b_tok_s_user_b1, f.p150a_8b_tok_s_user_b32, f.p150a_gddr6_gb_s) == (
        P150A.llama_8b_tok_s_user_b1, P150A.llama_8b_tok_s_user_b32, P150A.gddr6_gb_s)
    sim = p150a_decode()
    eng = engine_step_model("p150a", f.params / 4, f.layers, f.kv_heads // 4, f.head_dim, "bfp8_b")
    for b, ctx in ((1, 0), (32, 50_000), (7, 1234)):
        assert sim.step_time(b, ctx) == pytest.approx(eng.step_time(b, ctx))


def test_config_choices_match_the_timing_models():
    assert config.NPU_TIMINGS == timing.NPU_TIMINGS
    names = {f.name for f in config.options("serve")}
    assert {"npu_timing", "link_gbps"} <= names and {"npu_timing", "link_gbps"} <= {f.name for f in config.options("demo")}
    cfg = config.defaults()
    assert cfg.npu_timing is None and cfg.link_gbps is None
    with pytest.raises(config.ConfigError):
        config.defaults(npu_timing="h100").validate()
    with pytest.raises(config.ConfigError):
        config.defaults(link_gbps=0.0).validate()


def test_copy_model_charges_the_busiest_channels_read_and_write():
    m = DramCopyModel(512.0, 8)  # 64 GB/s per channel
    x = 64_000_000
    cross = m.copy_time(np.array([0]), np.array([1]), np.array([x]))
    intra = m.copy_time(np.array([2]), np.array([2]), np.array([x]))
    spread = m.copy_time(np.arange(8), (np.arange(8) + 1) % 8, np.full(8, x))
    assert cross == pytest.approx(1e-3) and intra == pytest.approx(2e-3) and spread == pytest.approx(2e-3)


def test_labels_say_emulated():
    assert timing_label(None, None) is None
    lab = timing_label("p150a", 200.0)
    assert "emulated" in lab and "p150a" in lab and "200 Gb/s" in lab


def test_pace_until_never_returns_early():
    t0 = time.perf_counter()
    pace_until(t0, 0.02)
    assert time.perf_counter() - t0 >= 0.02
    assert pace_until(time.perf_counter() - 1.0, 0.5) == 0.0  # already late: no sleep


# ---- the link: transport/paced.py ----------------------------------------------------------------


class FakeTransport:
    """The real transfer takes ``real_s``; counts calls."""

    name = "fake"

    def __init__(self, real_s: float = 0.0):
        self.real_s, self.ids, self.released = real_s, 0, 0

    def submit(self, op, peer, descs):
        self.ids += 1
        return TransferHandle(self.ids, op, peer, len(descs), sum(d for d in descs), frozenset())

    def poll(self, h):
        return "DONE" if time.monotonic() >= h.submitted_at + self.real_s else "PENDING"

    def wait(self, h, timeout_s):
        while self.poll(h) != "DONE":
            time.sleep(1e-4)

    def release(self, h):
        self.released += 1


def test_a_paced_transfer_completes_no_sooner_than_bytes_over_the_link():
    nbytes, gbps = 2_500_000, 1.0  # 20 ms at 1 Gb/s
    t = PacedTransport(FakeTransport(), gbps)
    t0 = time.monotonic()
    t.transfer("READ", "peer", [nbytes], timeout_s=5.0)
    assert time.monotonic() - t0 >= link_time_s(nbytes, gbps) == pytest.approx(0.02)
    assert t.inner.released == 1


def test_poll_holds_a_finished_batch_until_the_link_time():
    t = PacedTransport(FakeTransport(), 1.0)
    h = t.submit("READ", "peer", [5_000_000])  # 40 ms
    assert t.poll(h) == "PENDING"
    time.sleep(0.045)
    assert t.poll(h) == "DONE"


def test_a_transfer_slower_than_the_link_is_not_delayed_further():
    t = PacedTransport(FakeTransport(real_s=0.03), 1000.0)  # link time: microseconds
    t0 = time.monotonic()
    t.transfer("READ", "peer", [1_000_000], timeout_s=5.0)
    assert 0.03 <= time.monotonic() - t0 < 0.03 + 0.02


def test_link_off_returns_the_transport_itself():
    t = LocalTransport()
    try:
        assert paced(t, None) is t
        assert isinstance(paced(t, 10.0), PacedTransport)
        assert paced(t, 10.0).agent_name == t.agent_name  # everything else is delegated
    finally:
        t.close()


def test_receiver_paces_only_when_asked():
    from hawk.connector.configs import GpuSide, make_receiver
    from hawk.layouts.gpu import GpuKVLayout

    layout = GpuKVLayout(2, 4, 16, 2, 8, "fp32")
    caches = layout.allocate("cpu")
    for gbps, kind in ((None, LocalTransport), (50.0, PacedTransport)):
        t = LocalTransport()
        r = make_receiver("gg-host", t, GpuSide(caches, layout, 1 << 20), link_gbps=gbps)
        try:
            assert type(r.transport) is kind
        finally:
            r.close()
            t.close()


# ---- the NPU's DRAM copies: devices/emulated.py --------------------------------------------------


def _npu(copy_timing):
    return EmulatedNpu(get_arch("blackhole-p150a", 8 << 20), "cpu", copy_timing)


def test_paced_npu_copy_takes_at_least_the_modelled_time():
    model = DramCopyModel(0.512, 8)  # 64 MB/s per channel, so 1 MB cross-channel = 15.6 ms
    npu = _npu(model)
    npu.write(0, 0, torch.arange(1 << 20, dtype=torch.int64).to(torch.uint8))
    t0 = time.perf_counter()
    npu.copy([Copy(0, 0, 1, 0, 1 << 20)])
    assert time.perf_counter() - t0 >= (1 << 20) / 64e6
    assert torch.equal(npu.read(1, 0, 1 << 20), npu.read(0, 0, 1 << 20))


def test_unpaced_npu_copy_never_enters_the_pacing_path(monkeypatch):
    npu = _npu(None)

    def boom(*a, **k):
        raise AssertionError("pacing path entered with timing off")

    monkeypatch.setattr(EmulatedNpu, "_paced_copy", boom)
    monkeypatch.setattr("hawk.devices.emulated.pace_until", boom)
    npu.copy([Copy(0, 0, 1, 0, 4096)])


# ---- the decode step: engine/decode_engine.py ------------------------------------------------------


@pytest.fixture(scope="module")
def colocated():
    from hawk.engine.instances import ColocatedInstance, InstanceConfig

    torch.set_num_threads(1)
    c = ColocatedInstance(InstanceConfig(model="tiny", transfer="colocated", kv_tokens=1024))
    yield c
    c.close()


def _tpot(c, rid: str, n: int = 6) -> float:
    from hawk.bench.equivalence import run_colocated
    from hawk.engine.sequence import SamplingParams

    t0 = time.perf_counter()
    toks, _ = run_colocated(c, [5, 17, 99, 3, 42] * 4, SamplingParams(max_tokens=n, ignore_eos=True), rid)
    assert len(toks) == n
    return (time.perf_counter() - t0) / (n - 1)


def test_a_paced_decode_step_takes_at_least_the_modelled_time(colocated):
    seen = []

    def model(batch: int, ctx: int) -> float:
        seen.append((batch, ctx))
        return 0.05

    colocated.decode.step_time = model
    try:
        assert _tpot(colocated, "paced") >= 0.05
    finally:
        colocated.decode.step_time = None
    assert seen and all(b == 1 and ctx > 20 for b, ctx in seen)


def test_decode_with_timing_off_never_enters_the_pacing_path(colocated, monkeypatch):
    from hawk.engine.decode_engine import DecodeEngine

    def boom(*a, **k):
        raise AssertionError("pacing path entered with timing off")

    monkeypatch.setattr(DecodeEngine, "_pace", boom)
    monkeypatch.setattr("hawk.engine.decode_engine.pace_until", boom)
    assert colocated.decode.step_time is None
    _tpot(colocated, "unpaced")


# ---- the simulator with the same pacing: known answers ---------------------------------------------


def _one_request_config(link_gbps=None, floor=None):
    from hawk.sim.calibration import TransferCurve
    from hawk.sim.cluster import SimConfig
    from hawk.sim.compute import DecodeModel, PrefillModel

    curve = TransferCurve("t", (1.0, 1e9), (0.010, 0.010 + 1e9 / 10e9))  # 10 ms + bytes at 10 GB/s
    return SimConfig("x", curve, PrefillModel(0.1, 0.001), DecodeModel(0.02, 0.0, 0.0, floor=floor), bytes_per_token=1_000_000,
                     contention="none", link_gbps=link_gbps)


def _only(cfg, n_in=100, n_out=5):
    from hawk.sim.cluster import simulate
    from hawk.sim.workload import LengthDist, Workload

    wl = Workload("one", LengthDist(n_in), LengthDist(n_out), 1e9, 1e9)
    return simulate(cfg, 1.0, wl, 1, per_request=True)["requests"][0]


def test_sim_one_request_ttft_is_prefill_plus_paced_transfer():
    base = _only(_one_request_config())
    nbytes = 100 * 1_000_000
    assert base["ttft_s"] == pytest.approx(0.1 + 0.1 + 0.010 + nbytes / 10e9)  # prefill + transfer (solo)
    link = 8.0  # Gb/s: 100 MB takes 100 ms on the link vs 10 ms of bytes measured
    r = _only(_one_request_config(link_gbps=link))
    assert r["ttft_s"] == pytest.approx(0.1 + 0.1 + 0.010 + max(nbytes / 10e9, nbytes * 8 / (link * 1e9)))
    assert r["tpot_s"] == pytest.approx(0.02)


def test_sim_paced_step_is_the_larger_of_measured_and_modelled():
    slow = StepModel(0.05, 0.0, 0.0)
    assert _only(_one_request_config(floor=slow))["tpot_s"] == pytest.approx(0.05)
    fast = StepModel(0.001, 0.0, 0.0)
    assert _only(_one_request_config(floor=fast))["tpot_s"] == pytest.approx(0.02)


def test_sim_frontend_delay_adds_to_ttft_only():
    cfg = _one_request_config()
    a, b = _only(cfg), _only(replace(cfg, frontend_s=0.03))
    assert b["ttft_s"] == pytest.approx(a["ttft_s"] + 0.03) and b["tpot_s"] == pytest.approx(a["tpot_s"])
