"""Paper §5.1.3: under the same request stream and the same NPU memory, the single contiguous
receive buffer (gn-direct-single) ends in a per-channel out-of-memory; HAWK's per-channel buffers do not.

The stream: requests arrive one after another; each one's KV is pulled into the NPU cache and the
request joins the decode batch. Every decode step allocates its working tensors DRAM-interleaved
(as tt-metal places activations), sized by the batch, and frees them after the step.
"""

import pytest
import torch

from hawk.connector.configs import NpuSide, make_receiver, make_sender
from hawk.devices.dram_allocator import NpuOutOfMemory
from hawk.devices.emulated import open_npu
from hawk.layouts.gpu import GpuKVLayout
from hawk.layouts.npu import NpuKVLayout
from hawk.memory.npu_kv_cache import NpuKVCacheMemory
from hawk.plan.cost_model import cost_model_for
from hawk.transport.local import LocalTransport

MiB = 1 << 20
BANK = 16 * MiB
RX_TOTAL = 8 * MiB  # the same receive memory in both configurations
STEP_BYTES_PER_REQUEST = MiB // 2  # per bank, per running request


def _stream(config: str, requests: int = 16) -> tuple[int, NpuOutOfMemory | None]:
    src = GpuKVLayout(4, 128, 16, 2, 128)
    g = torch.Generator().manual_seed(1)
    caches = [torch.randn(src.layer_shape, generator=g).to(torch.bfloat16) for _ in range(src.num_layers)]
    tp, td = LocalTransport(), LocalTransport()
    sender = make_sender(config, tp, caches, src, 16 * MiB)
    npu = open_npu("npu-emu:cpu", "blackhole-p150a", bank_capacity=BANK)
    kv = NpuKVCacheMemory(npu, NpuKVLayout(npu.arch, 4, 64, 2, 64, 128))
    receiver = make_receiver(config, td, NpuSide(npu, kv, RX_TOTAL, cost_model_for("local", "cpu"), "staging"))
    running, oom = 0, None
    try:
        for i in range(requests):
            sender.add(f"r{i}", 256, list(range(16 * (i % 8), 16 * (i % 8) + 16)))
            receiver.pull(sender.address, f"r{i}", [4 * (i % 16) + k for k in range(4)])
            running += 1
            try:  # one decode step of the grown batch
                work = npu.allocate_interleaved(running * STEP_BYTES_PER_REQUEST, f"decode-step-{i}")
                npu.free(work)
            except NpuOutOfMemory as e:
                oom = e
                break
        return running, oom
    finally:
        receiver.close()
        sender.close()
        tp.close()
        td.close()
        kv.close()


def test_single_buffer_runs_out_in_one_channel_hawk_does_not():
    served_single, oom = _stream("gn-direct-single")
    assert oom is not None, "gn-direct-single should run out of per-channel memory"
    assert oom.channel == 0 and "channel 0" in str(oom)
    served_hawk, oom_hawk = _stream("gn-hawk")
    assert oom_hawk is None and served_hawk == 16
    assert served_single < served_hawk


def test_usage_is_balanced_with_per_channel_buffers():
    npu = open_npu("npu-emu:cpu", "blackhole-p150a", bank_capacity=BANK)
    from hawk.memory.buffers import ChannelBuffers, SingleBuffer

    hawk = ChannelBuffers(npu, RX_TOTAL // 8)
    used = [u for u, _ in npu.channel_usage().values()]
    assert max(used) == min(used) == RX_TOTAL // 8
    hawk.close()
    single = SingleBuffer(npu, RX_TOTAL)
    used = [u for u, _ in npu.channel_usage().values()]
    assert used[0] == RX_TOTAL and max(used[1:]) == 0
    single.close()
    with pytest.raises(NpuOutOfMemory, match="channel 0"):
        SingleBuffer(npu, BANK + 1)
