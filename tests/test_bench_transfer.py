"""``hawk bench transfer`` times its configurations in rounds: every configuration is set up at once,
and per size each round pulls one request of each, the first rotating, so that a drift of the machine
reaches every configuration alike. Each (configuration, size) still gets its own record with its
repeats, and nothing stays reserved on either side. Two processes, NIXL (or what ``auto`` finds) on
loopback; a tiny KV shape so it runs in seconds on the CPU."""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("UCX_NET_DEVICES", "lo")

from hawk.bench.transfer import BenchSpec, ModelShape, run_transfer_bench  # noqa: E402

CONFIGS = ("gg-direct", "gn-hawk", "gn-host")


def test_configurations_are_timed_in_rotating_rounds(monkeypatch):
    import hawk.connector.configs as configs

    order: list[str] = []
    real = configs.make_receiver

    def logging_receiver(config: str, *a: Any, **kw: Any) -> Any:
        rx = real(config, *a, **kw)
        pull = rx.pull

        def logged(*pa: Any, **pk: Any) -> Any:
            order.append(config)
            return pull(*pa, **pk)

        rx.pull = logged
        return rx

    monkeypatch.setattr(configs, "make_receiver", logging_receiver)
    spec = BenchSpec(sizes_mb=(1, 2), configs=CONFIGS, transport="auto", repeats=3, warmup=1,
                     shape=ModelShape(layers=2, kv_heads=2, head_dim=64))
    records = run_transfer_bench(spec)

    assert [(r["config"], r["size_mb"]) for r in records] == [(c, s) for s in (1, 2) for c in CONFIGS]
    assert all(r["interleaved"] == 3 and r["repeats"] == 3 and r["median_ms"] > 0 for r in records)
    assert all(r["bytes_moved"] > 0 and r["copy_ms"] for r in records)
    # 2 sizes x 4 rounds (1 warm-up + 3) x 3 configurations, each round starting one further on
    assert len(order) == 2 * 4 * 3
    firsts = [order[k * 3] for k in range(8)]
    assert firsts == ["gg-direct", "gn-hawk", "gn-host", "gg-direct"] * 2
    for k in range(8):
        assert sorted(order[k * 3:(k + 1) * 3]) == sorted(CONFIGS)
