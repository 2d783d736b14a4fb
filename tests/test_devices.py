"""The emulated NPU: lockstep interleaved allocation, per-channel accounting, page views, batched copies."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from hawk.devices.batched_copy import batched_copy
from hawk.devices.dram_allocator import DramAllocator, NpuOutOfMemory
from hawk.devices.emulated import EmulatedNpu, open_npu
from hawk.layouts.npu import NpuKVLayout, get_arch
from hawk.memory.npu_kv_cache import NpuKVCacheMemory
from hawk.plan.requests import Copy
from tests.npu_sim import ChannelMemory


def test_interleaved_buffers_share_one_address_in_every_bank():
    alloc = DramAllocator(get_arch("wormhole-n150", bank_capacity=1 << 20))
    a = alloc.allocate_interleaved(1000, "a")
    assert a.size == 1024 and a.banks == tuple(range(12))  # aligned to 32 B on Wormhole
    local = alloc.allocate_in_bank(3, 4096, "local")
    b = alloc.allocate_interleaved(100, "b")
    assert b.address >= local.address + local.size  # bank 3's hole blocks that address everywhere
    alloc.free(local)
    c = alloc.allocate_interleaved(100, "c")
    assert c.address == local.address
    with pytest.raises(ValueError, match="not live"):
        alloc.free(local)
    used = {u.bank: u.used for u in alloc.usage()}
    assert used[0] == a.size + 128 + 128


def test_out_of_memory_names_the_channel():
    alloc = DramAllocator(get_arch("blackhole-p150a", bank_capacity=1 << 16))
    alloc.allocate_in_bank(5, 60000, "big")
    with pytest.raises(NpuOutOfMemory, match="channel 5") as e:
        alloc.allocate_interleaved(10000, "kv")
    assert e.value.channel == 5


def test_emulated_pages_match_the_page_map():
    """Pages written through the cache's strided view sit where the layout's page map says."""
    for arch, shard in (("blackhole-p150a", 1), ("wormhole-n300", 1), ("blackhole-p100a", 1), ("blackhole-p150a", 3)):
        npu = open_npu("npu-emu:cpu", arch, bank_capacity=1 << 20)
        lay = NpuKVLayout(npu.arch, 1, 4, 2, 64, 64, "bfp8_b", shard_pages=shard)
        kv = NpuKVCacheMemory(npu, lay)
        x = torch.randn(lay.tensor_shape)
        sim = ChannelMemory(lay, list(kv.bases))
        sim.write_tensor(1, x)
        pages = np.arange(lay.pages_per_tensor)
        chan, addr = kv.page_locations(1, pages)
        for c, a in zip(chan, addr):
            npu.write(int(c), int(a), torch.from_numpy(sim.read(int(c), int(a), lay.page_size).copy()))
        assert torch.equal(kv.read_tensor(1), sim.read_tensor(1))
        kv.close()
        assert all(u == 0 for u, _ in npu.channel_usage().values())


def _copies():
    return [Copy(0, 64, 1, 128, 256), Copy(1, 0, 1, 1024, 64), Copy(2, 512, 0, 0, 32)]


def _expected(mem):
    want = mem.clone()
    for c in _copies():
        want[c.dst_region, c.dst_offset : c.dst_offset + c.length] = mem[c.src_region, c.src_offset : c.src_offset + c.length]
    return want


def test_batched_copy_cpu():
    mem = torch.randint(0, 255, (3, 2048), dtype=torch.uint8)
    want = _expected(mem)
    batched_copy(mem, _copies())
    assert torch.equal(mem, want)
    with pytest.raises(ValueError, match="outside"):
        batched_copy(mem, [Copy(0, 2040, 1, 0, 64)])


def _interpret(code: str) -> None:
    """Run ``code`` (which prints "ok" at its end) under Triton's interpreter in a fresh process."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert r.stdout.strip().endswith("ok"), r.stderr[-2000:]


def test_batched_copy_triton_kernel_in_interpreter():
    code = textwrap.dedent(
        """
        import numpy as np, torch
        from hawk.devices.batched_copy import _flat_offsets, _triton_copy
        from tests.test_devices import _copies, _expected
        mem = torch.randint(0, 255, (3, 2048), dtype=torch.uint8)
        want = _expected(mem)
        s, d, n = _flat_offsets(_copies(), 2048)
        _triton_copy(mem.view(-1), s // 8, d // 8, n // 8)
        assert torch.equal(mem, want)
        print("ok")
        """
    )
    _interpret(code)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batched_copy_cuda():
    dev = f"cuda:{torch.cuda.device_count() - 1}"
    mem = torch.randint(0, 255, (3, 2048), dtype=torch.uint8, device=dev)
    want = _expected(mem)
    batched_copy(mem, _copies())
    assert torch.equal(mem, want)


def test_unknown_device_is_a_clear_error():
    with pytest.raises(ValueError, match="npu-emu:cpu"):
        open_npu("tpu:0")
    with pytest.raises(RuntimeError, match="ttnn"):
        open_npu("ttnn:0")
    assert isinstance(open_npu("npu-emu:cpu", bank_capacity=1 << 16), EmulatedNpu)


def _pairs(dev: str) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]:
    """Twelve (dst, src) pairs of distinct tensors and sub-tensors, odd sizes in 8-byte words."""
    g = torch.Generator().manual_seed(3)
    src = torch.randint(0, 255, (4096,), dtype=torch.uint8, generator=g).to(dev)
    dst = torch.zeros(8192, dtype=torch.uint8, device=dev)
    pairs = [(dst[1024 * i + 8 : 1024 * i + 8 + 40 * (i + 1)], src[256 * i : 256 * i + 40 * (i + 1)]) for i in range(8)]
    others = [torch.randint(0, 255, (8 * (k + 3),), dtype=torch.uint8, generator=g).to(dev) for k in range(4)]
    outs = [torch.zeros_like(o) for o in others]
    return pairs + list(zip(outs, others)), [src, dst]


def test_copy_spans_refuses_what_it_cannot_do():
    from hawk.devices.batched_copy import copy_spans

    a = np.arange(10, dtype=np.int64) * 64
    assert not copy_spans(torch.device("cpu"), a, a + 4096, np.full(10, 64))  # not CUDA: the caller copies
    assert not copy_spans(torch.device("cpu"), a[:3], a[:3] + 4096, np.full(3, 64))  # too few
    assert not copy_spans(torch.device("cpu"), a + 1, a + 4096, np.full(10, 64), force=True)  # not 8-byte aligned
    assert not copy_spans(torch.device("cpu"), a, a + 4096, np.zeros(10, dtype=np.int64), force=True)  # empty


def test_copy_spans_kernel_in_interpreter():
    code = textwrap.dedent(
        """
        import numpy as np, torch
        from hawk.devices.batched_copy import copy_spans
        from tests.test_devices import _pairs
        pairs, _ = _pairs("cpu")
        want = [s.clone() for _, s in pairs]
        src = np.array([s.data_ptr() for _, s in pairs], dtype=np.int64)
        dst = np.array([d.data_ptr() for d, _ in pairs], dtype=np.int64)
        n = np.array([d.numel() for d, _ in pairs], dtype=np.int64)
        assert copy_spans(torch.device("cpu"), src, dst, n, force=True)
        assert all(torch.equal(d, w) for (d, _), w in zip(pairs, want))
        print("ok")
        """
    )
    _interpret(code)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_copy_spans_cuda():
    """A transport's many ranges of two regions on one GPU: one launch, the same bytes as slice copies."""
    from hawk.transport.local import copy_span_batch

    g = torch.Generator().manual_seed(5)
    a = torch.randint(0, 255, (1 << 16,), dtype=torch.uint8, generator=g).cuda()
    b = torch.zeros(1 << 16, dtype=torch.uint8, device="cuda")
    spans = [(b, 4096 * i + 8 * i, a, 2048 * i, 512 + 8 * i) for i in range(12)]
    streams: dict = {}
    batch = copy_span_batch(spans, streams)
    for ev in batch.events:
        ev.synchronize()
    for d, do, s, so, n in spans:
        assert torch.equal(d[do : do + n], s[so : so + n])


# ---- host staging of per-step metadata ------------------------------------------------------------


def test_host_staging_on_the_host_hands_the_buffers_themselves():
    """CPU buffers are their own staging: what next() hands is the buffer, upload() copies nothing."""
    from hawk.devices.staging import HostStaging

    a, b = torch.zeros(4, 3, dtype=torch.int32), torch.zeros(5, dtype=torch.int64)
    st = HostStaging([a, b])
    ha, hb = st.next()
    ha[1, 2], hb[4] = 7, -3
    st.upload((12, 5))
    assert a[1, 2] == 7 and b[4] == -3
    assert st.next()[0] is not None and st.slot == 0
    with pytest.raises(ValueError, match="one device"):
        HostStaging([])
    with pytest.raises(ValueError, match="contiguous"):
        HostStaging([torch.zeros(4, 4)[:, 1]])


def _staging_round_trips(dev: str, grow_to: int = 0) -> None:
    """Uploads of leading elements land, and the elements past ``counts`` keep what the device had.
    The GPU is kept milliseconds behind the host, so each upload is still queued when the host comes
    back to its slot two steps later: a snapshot taken on the stream right after each upload shows
    that step's values only if ``next()`` waited before handing the slot out again, or (``grow_to``)
    handed out a new slot instead, which it must then have done rather than wait."""
    from hawk.devices.staging import HostStaging

    bt = torch.full((8, 16), -1, dtype=torch.int32, device=dev)
    meta = torch.full((40,), -1, dtype=torch.int32, device=dev)
    st = HostStaging([bt, meta], slots=2, grow_to=grow_to)
    big = torch.zeros(1 << 26, device=dev)
    snaps = []
    for step in range(6):
        h_bt, h_meta = st.next()
        assert h_bt.shape == (8, 16) and h_meta.shape == (40,)
        h_bt[:3] = np.arange(48).reshape(3, 16) + 100 * step
        h_meta[:10] = np.arange(10) + 1000 * step
        for _ in range(20):
            big.mul_(1.0001)  # device work queued ahead of the copy
        st.upload((3 * 16, 10))
        snaps.append((bt.clone(), meta.clone()))
    torch.cuda.synchronize()
    for step, (s_bt, s_meta) in enumerate(snaps):
        assert torch.equal(s_bt[:3].cpu(), torch.from_numpy(np.arange(48).reshape(3, 16) + 100 * step).int()), step
        assert torch.equal(s_meta[:10].cpu(), torch.arange(10, dtype=torch.int32) + 1000 * step), step
        assert (s_bt[3:] == -1).all() and (s_meta[10:] == -1).all()
    assert len(st._host) > 2 if grow_to else len(st._host) == 2  # the GPU stayed behind: it grew instead of waiting
    st.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_staging_cuda_raw_runtime():
    from hawk.devices import cuda_runtime

    assert cuda_runtime.runtime() is not None, "torch's CUDA runtime should be loadable on a CUDA box"
    _staging_round_trips("cuda")
    _staging_round_trips("cuda", grow_to=16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_staging_cuda_torch_fallback(monkeypatch):
    from hawk.devices import staging

    monkeypatch.setattr(staging, "runtime", lambda: None)
    _staging_round_trips("cuda")
    _staging_round_trips("cuda", grow_to=16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_span_copier_takes_same_gpu_batches_cuda():
    """With copiers, a same-GPU batch goes through the SpanCopier (raw-event completion): its copy runs
    after the work queued on the caller's stream before the submit (here the fill that writes the
    source, behind milliseconds of other work), and its tables grow past their first 64 ranges."""
    from hawk.devices.span_copier import RawEvent
    from hawk.transport.local import copy_span_batch

    a = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    b = torch.zeros_like(a)
    big = torch.zeros(1 << 26, device="cuda")
    streams: dict = {}
    copiers: dict = {}
    for n in (12, 100, 300):
        b.zero_()
        val = n % 251 + 1
        for _ in range(10):
            big.mul_(1.0001)
        a.fill_(val)
        spans = [(b, 2048 * i, a, 1024 * i, 512 + 8 * (i % 8)) for i in range(n)]
        batch = copy_span_batch(spans, streams, copiers)
        assert batch.events and all(isinstance(e, RawEvent) for e in batch.events)
        batch.block()
        want = np.zeros(b.numel(), dtype=np.uint8)
        for _, do, _, _, ln in spans:
            want[do : do + ln] = val
        assert np.array_equal(b.cpu().numpy(), want), n
    for c in copiers.values():
        c.close()
