"""Tensor-parallel instances (gloo on the CPU, one process per rank): sharded weights are exact
slices of the whole model, heterogeneous prefill/decode TP produces the colocated TP1 oracle's
greedy tokens, and a dead decode rank leaves nothing reserved on the surviving ranks.

Token equality, not bit equality: the row-parallel sums add the ranks' partial products in rank
order (tensor_parallel.TPGroup.all_reduce), TP1 adds them inside one matmul; the tests assert the
greedy tokens of the tested prompts (docs/tensor_parallel.md).
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from hawk.bench.equivalence import PROMPTS, run, run_disaggregated
from hawk.engine.config import preset
from hawk.engine.instances import DecodeInstance, InstanceConfig, PrefillInstance
from hawk.engine.loader import load_hf_dir, load_model, save_hf_dir
from hawk.engine.model import LlamaModel
from hawk.engine.sequence import SamplingParams
from hawk.engine.tensor_parallel import Shard, kv_request_id, overlapping_ranks, take_slice
from hawk.engine.tp_ranks import FAULT_ENV

CONFIGS = ["gn-hawk", "gg-direct", "gn-host"]


@pytest.fixture(autouse=True)
def loopback(monkeypatch):
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")


def _assert_slices(sharded: torch.nn.Module, whole: dict[str, torch.Tensor], shard: Shard) -> None:
    for name, p in sharded.state_dict().items():
        assert torch.equal(p, take_slice(name, whole[name], shard)), name


@pytest.mark.parametrize("tp", [2])
def test_sharded_preset_init_is_the_slice_of_the_whole_init(tp):
    cfg = preset("tiny")
    whole = LlamaModel.from_config(cfg, seed=3, fuse=False).state_dict()
    for r in range(tp):
        _assert_slices(LlamaModel.from_config(cfg, seed=3, fuse=False, shard=Shard(r, tp)), whole, Shard(r, tp))


def test_sharded_gguf_and_hf_loads_read_exact_slices(tmp_path):
    smol = load_model("smollm2-135m")  # 3 KV heads: TP 3
    whole = smol.model.state_dict()
    for r in range(3):
        _assert_slices(load_model("smollm2-135m", shard=Shard(r, 3)).model, whole, Shard(r, 3))
    tiny = load_model("tiny")
    save_hf_dir(tiny, tmp_path)
    for r in range(2):
        _assert_slices(load_hf_dir(tmp_path, shard=Shard(r, 2)).model, tiny.model.state_dict(), Shard(r, 2))


def test_a_degree_that_does_not_divide_the_kv_heads_is_refused():
    with pytest.raises(ValueError, match="does not divide the number of KV heads"):
        load_model("smollm2-135m", shard=Shard(0, 2))


def test_kv_routing_pairs_every_shared_head_once():
    assert overlapping_ranks(range(0, 1), 2, 2) == [0]  # TP2 -> TP2: each rank its peer only
    assert overlapping_ranks(range(0, 1), 2, 1) == [0]  # N > M: several senders, one receiver
    assert overlapping_ranks(range(0, 2), 2, 2) == [0, 1]  # N < M: one sender, two receivers
    assert kv_request_id("r", 0, 1) == "r" and kv_request_id("r", 1, 2) == "r#d1"


def _base(**kw) -> InstanceConfig:
    return InstanceConfig(model="tiny", transport="nixl", kv_tokens=1024, staging_mb=16, rx_mb=16, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2), (2, 2)])
def test_heterogeneous_tp_matches_the_tp1_colocated_oracle_on_tiny(prefill_tp, decode_tp):
    records = run(_base(prefill_tp=prefill_tp, decode_tp=decode_tp), CONFIGS, prompts=PROMPTS[:2], max_tokens=12)
    assert len(records) == 2 * len(CONFIGS)
    for r in records:
        assert r["identical"], (prefill_tp, decode_tp, r["config"], r["prompt"])
        assert r["kv_bytes"] > 0 and r["tokens"] > 0


@pytest.fixture(scope="module")
def _loaded_models() -> dict:
    return {}


@pytest.fixture
def smollm2_loads_once(_loaded_models: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """``load_model`` in this process (each run's oracle, and rank 0's of each instance) memoized across the
    SmolLM2 runs: each run's oracle and six instances read the same GGUF (about 10 s a time on CPU) into
    the same weights. One instance is closed before the next takes a model, as ``equivalence.run`` already
    does with the oracle's model for every TP1 prefill; the follower ranks are processes of their own and
    still load their slices. Only these tests see it (the module's cache is dropped with the module)."""
    import hawk.bench.equivalence as equivalence
    import hawk.engine.instances as instances
    import hawk.engine.ranks as ranks

    real = instances.load_model

    def load_once(spec, device="cpu", dtype=torch.float32, seed=0, shard=Shard()):
        key = (spec, str(device), dtype, seed, shard)
        if key not in _loaded_models:
            _loaded_models[key] = real(spec, device, dtype, seed, shard=shard)
        return _loaded_models[key]

    monkeypatch.setattr(equivalence, "load_model", load_once)
    monkeypatch.setattr(instances, "load_model", load_once)
    monkeypatch.setattr(ranks, "load_model", load_once)  # rank 0 of a prefill or decode instance


@pytest.mark.slow
@pytest.mark.parametrize("prefill_tp,decode_tp,config", [(3, 1, "gn-hawk"), (1, 3, "gg-direct")])
def test_heterogeneous_tp_matches_the_oracle_on_smollm2(prefill_tp: int, decode_tp: int, config: str, smollm2_loads_once):
    """SmolLM2 has 3 KV heads: its degrees are 1 and 3 (3 -> 3 passes from the command line too). One
    configuration per direction (each is three processes on CI's two cores); the tiny model's TP tests
    run every configuration at every degree pair."""
    base = InstanceConfig(transport="nixl", kv_tokens=1024, staging_mb=16, rx_mb=16, prefill_tp=prefill_tp, decode_tp=decode_tp)
    records = run(base, [config], prompts=PROMPTS[:1], max_tokens=8)
    for r in records:
        assert r["identical"], (r["config"], r["text"])
    assert all("Paris" in r["text"] for r in records)


def _empty_prefill(a: dict) -> bool:
    return a["staging_reservations"] == 0 and not a["kv_waiting"] and not a["kv_in_flight"] and a["draining"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("transfer", ["gn-hawk"])
def test_a_decode_rank_killed_mid_transfer_fails_the_request_and_leaves_no_reservation(monkeypatch, transfer):
    cfg = _base(transfer=transfer, prefill_tp=2, decode_tp=2, kv_ttl_s=1.0)
    p = PrefillInstance(cfg)
    try:
        monkeypatch.setenv(FAULT_ENV, "die-in-pull")  # the decode follower exits when its pull arrives
        d = DecodeInstance(cfg)  # (its process inherits the variable; this one ignores it)
        monkeypatch.delenv(FAULT_ENV)
        try:
            ids = p.loaded.tokenizer.encode("the memory channels of an NPU")
            with pytest.raises(RuntimeError):
                run_disaggregated(p, d, ids, SamplingParams(max_tokens=4), "doomed")
            assert not d.healthy and p.healthy
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                pa, da = p.accounting(), d.accounting()
                ranks_empty = all(_empty_prefill(a) for a in pa["ranks"].values())
                if _empty_prefill(pa) and ranks_empty and da["rx_reservations"] == 0 and da["draining"] == 0 and pa["gpu_blocks_used"] == 0 and da["kv_blocks_used"] == 0:
                    break
                time.sleep(0.2)
            assert _empty_prefill(pa), pa
            assert all(_empty_prefill(a) for a in pa["ranks"].values()), pa["ranks"]
            assert da["rx_reservations"] == 0 and da["draining"] == 0, da
            assert pa["gpu_blocks_used"] == 0 and da["kv_blocks_used"] == 0
            assert da["ranks"][1].get("dead")
        finally:
            d.close()
    finally:
        p.close()


def test_tp_options_reach_the_config():
    cfg = replace(_base(), prefill_tp=2, decode_tp=4)
    assert InstanceConfig.from_json(cfg.to_json()).decode_tp == 4


def test_a_prefill_rank_dying_at_start_fails_the_constructor_with_rank_died(monkeypatch):
    """A follower that dies while rank 0 is still loading (on a GPU box: a transport it cannot build)
    fails the instance with RankDied, and the dead-rank handler runs without tripping over the
    half-built instance."""
    from hawk.engine.tp_ranks import RankDied

    errors: list[BaseException] = []
    monkeypatch.setattr("threading.excepthook", lambda a: errors.append(a.exc_value))
    monkeypatch.setenv(FAULT_ENV, "die-at-start")
    with pytest.raises(RankDied):
        PrefillInstance(_base(prefill_tp=2))
    assert errors == []
