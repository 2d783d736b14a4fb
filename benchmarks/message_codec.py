"""Host cost of Algorithm 1's control messages: encode + decode of a KVReady / PullRequest per block count.

Why: a KVReady carries the request's GPU block ids (1024 for 16k tokens of 16-token blocks) and a
PullRequest the decode's blocks; both cross the control channel on every pull's critical path. This
times ``messages.encode`` + ``decode`` beside the encoding the connector used before session 8
(``dataclasses.asdict``, which copies every list element by element), in the same run.

    python benchmarks/message_codec.py            # prints a table; --json FILE writes the records
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hawk.connector.messages import VERSION, KVReady, PullRequest, decode, encode  # noqa: E402


def _asdict_encode(msg) -> bytes:
    return msgpack.packb({"v": VERSION, "type": msg.TYPE, **dataclasses.asdict(msg)}, use_bin_type=True)


def _us(fn, msg, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(msg)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", default="8,64,256,1024")
    p.add_argument("--repeats", type=int, default=500)
    p.add_argument("--json")
    a = p.parse_args()
    records = []
    for n in (int(x) for x in a.blocks.split(",")):
        msgs = {
            "KVReady": KVReady("r", "npu-tiles", 16 * n, list(range(n)), "", 0, 1 << 30, [[c, 0, 1 << 27] for c in range(8)], [], {"plan_s": 1e-4}),
            "PullRequest": PullRequest("r", "rx", list(range(max(1, n // 4))), True, True),
        }
        for name, m in msgs.items():
            assert decode(encode(m)) == m and decode(_asdict_encode(m)) == m
            now = _us(lambda x: decode(encode(x)), m, a.repeats)
            before = _us(lambda x: decode(_asdict_encode(x)), m, a.repeats)
            records.append({"message": name, "block_ids": len(m.src_block_ids if name == "KVReady" else m.dst_block_ids),
                            "round_trip_us": now, "asdict_round_trip_us": before})
    print(f"{'message':<12} {'ids':>5} {'encode+decode us':>17} {'with asdict us':>15}")
    for r in records:
        print(f"{r['message']:<12} {r['block_ids']:>5} {r['round_trip_us']:>17.1f} {r['asdict_round_trip_us']:>15.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
