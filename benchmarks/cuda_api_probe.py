"""Host cost of the CUDA calls a decode step and a transfer make, on this machine (GPU only).

Why: on the H200 hosts here a torch call that reaches CUDA costs microseconds, and a decode step or a
same-GPU transfer makes dozens; this prints what each costs (mean over many calls, no sync inside the
loop), so a change to the host path can be judged against the calls it removes.

    python benchmarks/cuda_api_probe.py
"""

from __future__ import annotations

import time

import torch

from hawk.devices.cuda_runtime import HOST_TO_DEVICE, runtime


def per_call_us(fn, n: int = 2000) -> float:  # noqa: ANN001 - any callable
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    dev = torch.device("cuda:0")
    d = torch.zeros(4096, dtype=torch.int64, device=dev)
    h = torch.zeros(4096, dtype=torch.int64, pin_memory=True)
    ev = torch.cuda.Event()
    ev.record()
    x = torch.zeros(16, device=dev)
    rows = {
        "tensor slice": per_call_us(lambda: d[:64]),
        "copy_ 512 B host->device": per_call_us(lambda: d[:64].copy_(h[:64], non_blocking=True), 500),
        "Event.record()": per_call_us(ev.record),
        "Event.synchronize() (done)": per_call_us(ev.synchronize),
        "torch.cuda.current_stream()": per_call_us(lambda: torch.cuda.current_stream(dev)),
        "torch.empty(1) on the GPU": per_call_us(lambda: torch.empty(1, dtype=torch.int64, device=dev)),
        "x.add_(1) (a kernel launch)": per_call_us(lambda: x.add_(1), 500),
    }
    rt = runtime()
    if rt is not None:
        s = torch.cuda.current_stream(dev).cuda_stream
        dp, hp = d.data_ptr(), h.data_ptr()
        rows["raw cudaMemcpyAsync 512 B"] = per_call_us(lambda: rt.memcpy_async(dp, hp, 512, HOST_TO_DEVICE, s), 500)
        e = rt.event_create()
        rows["raw cudaEventRecord"] = per_call_us(lambda: rt.event_record(e, s))
        torch.cuda.synchronize()
        rt.event_destroy(e)
    torch.cuda.synchronize()
    for nodes in (50, 400):  # a graph's launch and its per-node time on the device
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            x.add_(1)
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            for _ in range(nodes):
                x.add_(1)
        rows[f"graph launch, {nodes} tiny kernels"] = per_call_us(g.replay, 200)
        torch.cuda.synchronize()
    for name, us in rows.items():
        print(f"{name:36s} {us:8.2f} us")


if __name__ == "__main__":
    main()
