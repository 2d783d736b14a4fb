"""What a full garbage collection costs an engine process, before and after its startup heap is frozen.

Builds one instance as ``hawk serve`` would (default: colocated SmolLM2 on the CPU), then times
``gc.collect()`` (a full, stop-the-world collection: what CPython runs every so often on whatever
thread allocates) with the startup heap tracked, freezes it (``hawk.engine.gc_policy``, what the
engine processes do once they are up, ``--gc-freeze``) and times it again, in the same run.

    python benchmarks/gc_pause.py [--model smollm2-135m] [--device cpu] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

from hawk.engine.gc_policy import freeze_startup_heap
from hawk.engine.instances import ColocatedInstance, InstanceConfig


def full_collection_ms(repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        gc.collect()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default="")
    a = p.parse_args()
    inst = ColocatedInstance(InstanceConfig(model=a.model, transfer="colocated", prefill_device=a.device, decode_device=a.device, kv_tokens=2048))
    try:
        gc.collect()
        tracked = len(gc.get_objects())
        before = full_collection_ms(a.repeats)
        frozen = freeze_startup_heap()
        after = full_collection_ms(a.repeats)
    finally:
        inst.close()
    rec = {"model": a.model, "device": a.device, "tracked_before": tracked, "frozen": frozen,
           "full_collection_ms_before": statistics.median(before), "full_collection_ms_after": statistics.median(after),
           "all_before": before, "all_after": after}  # fmt: skip
    print(f"{a.model} on {a.device}: {tracked} tracked objects; a full collection took {rec['full_collection_ms_before']:.1f} ms "
          f"(median of {a.repeats}); after freezing {frozen} objects, {rec['full_collection_ms_after']:.2f} ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
