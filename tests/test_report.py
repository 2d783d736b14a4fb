"""``hawk report`` on hand-made result files: kinds recognised by content, unknown files skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hawk.bench.report import classify, main, write_report


def _write(d: Path, name: str, data: object) -> Path:
    p = d / name
    p.write_text(json.dumps(data))
    return p


def _serving(sim: bool) -> list[dict]:
    return [{"simulated": sim, "config": "gn-hawk", "workload": "chatbot", "rate": r, "slo_attainment": a, "completed": 10, "num_requests": 10,
             "ttft_p90_ms": 100 * r, "tpot_p90_ms": 50.0, "slo_ttft_ms": 2000, "slo_tpot_ms": 200, "output_throughput_tok_s": 100 * r,
             "goodput_tok_s": 90 * r, "decode_device": "npu-emu:cpu"} for r, a in ((1, 1.0), (2, 0.95), (3, 0.5))]


FILES = {
    "engine.json": [{"kind": "decode", "path": "npu-tile", "kv_dtype": "bf16", "batch": 1, "context": c, "tokens": None, "ms": 2.0 * c / 128,
                     "floor_ms": 1.0 * c / 128, "ratio": 2.0, "device": "cpu"} for c in (128, 512)]
                   + [{"kind": "prefill", "path": "gpu-paged", "kv_dtype": "bf16", "batch": 1, "tokens": 128, "ms": 9.0, "ratio": 0.4}],
    # producers that write a header beside their records ({"command": ..., "records": [...]})
    "xfer.json": {"command": "hawk bench transfer", "records": [
        {"config": c, "size_mb": s, "median_ms": s / k, "transport": "nixl", "prefill_device": "cpu", "decode_device": "cpu"}
        for c, k in (("gg-direct", 10), ("gn-hawk", 9)) for s in (10, 20)]},
    "transform.json": {"what": "transform vs copy", "records": [
        {"impl": "triton", "dtype": "bf16", "blocks": "shuffled", "size_mb": s, "gbps": 3.0 * s, "copy_gbps": 3.2 * s, "ratio": 0.94,
         "match": True, "device": "cuda:0"} for s in (80, 320)]},
    "paper.json": {"simulated": True, "testbed": "paper", "rows": [
        {"figure": "Fig. 9", "quantity": "a ratio", "paper": 2.0, "ours": 2.2, "unit": "x", "deviation": "+10.0 %"},
        {"figure": "Fig. 12", "quantity": "never reached", "paper": None, "ours": 1.5, "unit": "req/s"}]},
    "serving.json": _serving(False),
    "sim.json": {"records": _serving(True)},
}


def _ramp(config: str, served: tuple[float, ...]) -> dict:
    rates = [8.0 * 1.5**i for i in range(len(served))]
    return {"config": config, "saturation_rps": max(served), "saturation_rate": rates[served.index(max(served))], "saturation_over_bound": 0.9,
            "bound": {"bound_rps": max(served) / 0.9}, "slo90_rate_rps": rates[0],
            "ramp": [{"rate": r, "steady_throughput_rps": t, "ttft_median_ms": 100.0, "tpot_median_ms": 20.0, "itl_p99_ms": 50.0,
                      "slo_attainment": 1.0 if i == 0 else 0.5, "slo_ttft_ms": 2000} for i, (r, t) in enumerate(zip(rates, served))]}


SATURATION = {"command": "bash scripts/gpu_suite.sh saturation", "device": "one GPU", "summary": [], "records": [],
              "runs": [_ramp("colocated", (7.9, 11.5, 12.0)), _ramp("gn-hawk_gpu0", (7.8, 11.9, 13.0))],
              "acceptance": {"disaggregated_over_colocated": {"value": 1.08, "limit": ">= 0.9", "holds": True}}}


def test_a_saturation_summary_gets_its_own_section(tmp_path):
    """Not read as a serving sweep (it carries records too): its ramps, saturation and ratios."""
    assert classify(SATURATION) == "saturation" and classify(SATURATION["runs"][0]) == "saturation"
    _write(tmp_path, "sat.json", SATURATION)
    md = write_report([tmp_path / "sat.json"], tmp_path / "out").read_text()
    assert "Throughput at saturation (measured): `sat.json`" in md
    assert "| colocated | 12 | 18 | 0.9 | 13.3 | 8 |" in md  # saturation, at offered, over bound, bound, 90 % SLO
    assert "| gn-hawk_gpu0 | 18 | 13 | 100 | 20 | 50 | 0.5 |" in md  # one rate of a ramp
    assert "| disaggregated_over_colocated | 1.08 | >= 0.9 | yes |" in md
    assert (tmp_path / "out" / "sat.png").is_file()


def test_classify_by_content():
    assert [classify(FILES[k]) for k in ("engine.json", "xfer.json", "paper.json", "serving.json", "sim.json")] == \
        ["engine", "transfer", "reproduce", "serving", "sim"]
    assert classify({"a": 1}) is None and classify([]) is None and classify([1, 2]) is None


def test_report_writes_tables_plots_and_skips_unknown(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    for name, data in FILES.items():
        _write(src, name, data)
    _write(src, "other.json", {"hello": "world"})
    (src / "broken.json").write_text("{")
    (src / "notes.txt").write_text("not a result")
    out = tmp_path / "out"
    md = write_report([src], out).read_text()
    for heading in ("Engine benchmark", "KV transfer benchmark", "Transform benchmark", "Paper vs simulator", "Serving benchmark (measured)",
                    "Simulated serving sweep"):
        assert heading in md
    assert "`other.json`: unknown kind" in md and "`broken.json`: not valid JSON" in md and "`notes.txt`: not a JSON file" in md
    assert "| 10 | 1 | 1.11 |" in md  # transfer table: size, then one column per configuration
    assert "interpolated" in md  # the 90 % operating point of the sweep
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["engine.png", "paper.png", "serving.png", "sim.png", "transform.png", "xfer.png"]
    assert sum(p.stat().st_size for p in out.iterdir()) < 1_000_000
    for p in pngs:
        assert f"]({p})" in md


def test_cli_entry_and_missing_path(tmp_path):
    _write(tmp_path, "xfer.json", FILES["xfer.json"])
    assert main([str(tmp_path / "xfer.json"), "--out", str(tmp_path / "r")]).is_file()
    with pytest.raises(SystemExit):
        main([str(tmp_path / "nope"), "--out", str(tmp_path / "r")])
