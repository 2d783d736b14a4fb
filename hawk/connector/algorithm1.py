"""Algorithm 1 of the paper: moving one request's KV cache from the GPU prefill instance to the
NPU decode instance, with both sides releasing what they reserved.

    Decode side: KVReceiver.pull()                   Prefill side: KVSender
    D1  ask the prefill for request r's KV  ───────▶ P1  receive the request
                                                     P2  retrieve r's KV (its paged GPU blocks)
                                                     P3  transfer-aware transformation     \\ one pass: the transform
                                                     P4  reserve space in the RDMA buffer  | writes straight into
                                                     P5  copy the tensor into that space   / the reservation
                                                     P6  give the paged blocks back to the prefill's pool
    D2  receive metadata (size, offset) ◀─────────── P7  send metadata
    D3  reserve space in the per-channel NPU buffers
    D4  pair GPU regions with per-channel buffers: one request per channel
    D5  submit all requests as one batch
    D6  wait for the batch to complete
    D7  rebuild the NPU KV cache from the buffers (intra-channel copies, or none)
    D8  release the per-channel reservations
    D9  tell the prefill it is done  ──────────────▶ P8  receive the notice
                                                     P9  release the RDMA-buffer reservation

Landed pull: where the prefill can address the decode's pages (the same GPU, in-process or through
CUDA IPC) and D1 allows it (``land``), P3 + P5 write the tiles straight into them, P4 reserves
nothing, D2 says ``landed`` and D3-D6 do nothing; D7 only makes the pages visible. A decode in another
process on that GPU may wait on a CUDA IPC event instead (D1 ``ready_event_ok``): then P7 leaves while
the transform still runs, D2 names the event, and D7 waits for it first (the hop overlaps the transform).
P6 then waits for D9 (as gg-direct's in-place reads do): the transform may still read the blocks when P7
leaves, and P7 leaves sooner without the pool's callback. D2 carries no block ids or extents (nothing to
pair), and the decode plans nothing while D1 is in flight when it expects the sender to land.

Every step is the same for the five configurations; what differs (the send format, where the
decode side lands the bytes) lives in ``formats`` and ``landings``. Failure paths release too:
an un-pulled request expires on the prefill side; a failed or timed-out batch, a dead prefill or
malformed metadata fails the request on the decode side and releases its reservations.

Back-pressure: a decode that has a request queued, waiting for its own KV memory, sends KeepAlive
for it (about four per TTL); each extends the un-pulled KV's deadline by one TTL. So a busy decode
delays a request instead of letting it expire into an error, while an aborted request, or a dead
or closed decode, stops the keep-alives and the TTL still releases the KV. The prefill offers this
in its handshake (``keepalive``, ``ttl_s``), and a decode sends it to no prefill that did not. A TTL
counts the decode's silence: a stall of the prefill's own process (its reaper wakes late) moves the
deadlines by the stall, as no keep-alive or D9 could be taken meanwhile.
Staging is back-pressure too: a pull that finds P4's buffer full waits, in arrival order, for D9s
and expiries to make room (the stager thread answers its D1 then), rather than failing or holding a
control thread (the D9s that free staging arrive on those threads). It waits at most one TTL, and
no longer than its decode waits for D2: a decode that stops waiting sends D9 not ok, which drops it
from the queue (so a dead prefill is still noticed: within seconds by its refused port, else at the
decode's own timeout). The decode's receive buffers are back-pressure too: a D3 that finds no free
range large enough (concurrent pulls fragment a first-fit buffer) waits, in arrival order, for D8s to
make room, at most the pull's timeout and half the sender's TTL (the staged bytes must outlive
D5-D6); one that exceeds the empty buffer fails at once.

Layer-wise flow (``kv_flow=layerwise``; the prefill offers ``layerwise`` in its handshake). The same
steps, reordered so that the transfer hides behind prefill: the decode allocates the request's
blocks first and hands them over before the prefill runs.

    Decode side: KVReceiver.push_to()                Prefill side: KVSender
    D1  PushTo: request r lands in these blocks ───▶ P1  keep it as r's pending destination; Ack
    (the caller starts r's prefill as D1 leaves, and the prefill ``expect``s it: P2 waits briefly
    for P1, after its forward is launched on CUDA, so the Ack's way back is off the critical path)
                                                     P2  r's last forward begins (begin_push): plan
                                                         (P3's plan) and reserve staging (P4), on the
                                                         push worker, beside the forward
                                                     P3+P5  as each layer's forward finishes it: that
                                                         layer's transform on a side stream, then its
                                                         WRITE straight into r's pages (D4-D6 done by
                                                         the sender: it pairs and posts). Over a
                                                         stream-ordered transport (same host, CUDA) the
                                                         forward's thread posts both as it passes the
                                                         layer, ordered after it on the device; else
                                                         the push worker does, as the layer completes
                                                         (on a CPU: after the last one; the forward
                                                         fills the cores).
                                                         Where this process can address r's pages (the
                                                         same GPU), the transform writes them itself:
                                                         P3 and P5 in one pass, no staging, no WRITE
                                                     P6+P9  after the last write: release the staging
                                                         and the paged blocks
    D2  AwaitPush ◀──────────────────────────────── P7  Pushed (or Error), when all writes completed
        (Pending after a while without an outcome: asked again; each ask keeps the push alive)
    D7  make the pages visible (a device sync; no receive buffer, no copy: D3 and D8 hold nothing)
    on failure: D9 Done(ok=False) ─────────────────▶ P8  stop pushing; release (staging after drain)

TTFT waits only for the last layer's transform and write and one message. Release holds on every
path: a destination whose prefill never comes (cancelled, discarded) fails with an Error and is
forgotten; one nobody asks for expires after the TTL; a push whose decode vanished ends when its
writes fail or finish, and its outcome expires unclaimed; a decode whose wait fails treats its
blocks as possibly still written for the transport's drain time (:class:`PushFailed`).
"""

from __future__ import annotations

import contextlib
import collections
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from hawk.connector.control import ControlClient, ControlServer, Deferred, PeerUnreachable
from hawk.connector.formats import DirectTarget, Held, SendFormat, Staged
from hawk.connector.landings import Landing
from hawk.connector.layer_stream import DeviceWrite, SideStream, mark
from hawk.connector.messages import (
    Ack,
    AwaitPush,
    Done,
    Error,
    Hello,
    Holdings,
    Inspect,
    KeepAlive,
    KVReady,
    Message,
    Pending,
    ProtocolError,
    PullRequest,
    Pushed,
    PushRequest,
    PushTo,
    layout_from_wire,
    layout_to_wire,
    pack_ids,
)
from hawk.devices.ipc_events import EventRecorder, EventWaiter
from hawk.errors import DuplicateRequest
from hawk.memory.reservations import BufferFull, NeverFits, RoomQueue
from hawk.transport.base import Desc, DescArray, Transport, TransferError, desc_bytes
from hawk.transport.paced import PacedTransport

log = logging.getLogger(__name__)
#: A handshake's transport connect slower than this is logged (the decode gives up at its pull timeout).
SLOW_HELLO_S = 1.0
#: The prefill's reaper waking this much later than it asked means the process stalled (a long collection,
#: CPU starvation, a stopped process): the holds that wait on decodes are moved by the stall, not expired by it.
STALL_S = 0.5


class KVTransferFailed(RuntimeError):
    """The decode side could not get a request's KV; its reservations have been released."""


class PushFailed(KVTransferFailed):
    """A layer-wise push failed or was given up: the prefill may still be writing into the
    destination blocks for up to ``drain_s`` seconds, so they must not be reused before then."""

    def __init__(self, message: str, drain_s: float):
        super().__init__(message)
        self.drain_s = drain_s


# ============================================================================ prefill side


@dataclass
class _Prefilled:
    """A finished prefill whose KV waits for the decode side to ask (between prefill and P1)."""

    num_tokens: int
    block_ids: np.ndarray  # int64, converted when the prefill hands them over (off P1-P7's path)
    release_blocks: Callable[[], None] | None
    deadline: float


@dataclass
class _Sent:
    """A request between P4 and P9: what the sender still holds for it."""

    held: Held
    held_blocks: _Prefilled | None  # the paged blocks, kept until D9 where they are read after P7 (gg-direct, landed pulls)
    deadline: float


@dataclass(eq=False)
class _StagingWait:
    """A pull that found staging full (P4): it waits in the queue for room, holding its blocks, and
    its D1 is answered by the stager. ``staging``: the stager is inside P3-P5 for it (a D9 or the
    reaper then only marks ``cancelled``; the stager releases)."""

    msg: PullRequest
    job: _Prefilled
    plan: Any
    reply: Deferred
    t0: float
    t_plan: float
    deadline: float
    staging: bool = False
    cancelled: str = ""


def _device_of(fmt: SendFormat) -> Any:
    """Where the format's KV lives (the forward's device, whose stream the push follows)."""
    import torch

    caches = getattr(fmt, "caches", None)
    return caches[0].device if caches else torch.device("cpu")


@dataclass
class _Receiver:
    peer: str
    info: dict[str, Any]
    memory: Any = None  # the destination regions as tensors here (peer_tensors), once looked up
    memory_known: bool = False


#: A push-worker item meaning "every layer of this inline push is posted" (layer numbers are >= 0,
#: -1 is "plan it").
_ALL_POSTED = -2
#: Layers per inline post: ``$HAWK_LAYERWISE_GROUP``, else enough for about 8 posts per forward.
GROUP_ENV = "HAWK_LAYERWISE_GROUP"


def layer_group(num_layers: int) -> int:
    env = os.environ.get(GROUP_ENV)
    return max(1, int(env)) if env else max(1, -(-num_layers // 8))


#: ``0``: the sender never writes the decode's memory itself (the same GPU), keeping staging + WRITE for a
#: layer-wise push and staging + READ for a pull (for comparison, and for tests of those paths).
DIRECT_ENV = "HAWK_DIRECT_WRITE"
#: ``0``: a decode never lets a landed pull answer before its transform ends (CUDA IPC events; for comparison).
IPC_EVENTS_ENV = "HAWK_IPC_EVENTS"

#: ``0`` keeps every layer-wise push on the push worker (for comparison); default (``1``): inline on
#: CUDA when the transport is stream-ordered; ``always``: inline on a CPU too (tests: on a CPU the
#: copies then run on the forward's thread, which the worker would have overlapped).
INLINE_ENV = "HAWK_LAYERWISE_INLINE"
#: How many request ids no longer held (pulled, expired, discarded) a sender remembers, with why: a late or
#: repeated D1 for one is refused at once with the reason.
GONE_REMEMBERED = 4096


class PushState(Enum):
    """Where one layer-wise push is, on the prefill side."""

    WAITING = "waiting"  # P1: the destination is known; the prefill has not reached the request
    PUSHING = "pushing"  # its last forward runs; layers are produced and written as they finish
    PUSHED = "pushed"  # every write completed
    FAILED = "failed"  # given up (error, cancel, discard, expiry); nothing more is written


@dataclass(eq=False)
class _Push:
    """One request's layer-wise push, from its destination (D1) until its outcome is claimed and
    the engine has handed its blocks over (or will not)."""

    request_id: str
    receiver: _Receiver
    dst_block_ids: list[int]
    num_tokens: int
    deadline: float
    state: PushState = PushState.WAITING
    src_block_ids: list[int] = field(default_factory=list)
    plan: Any = None
    staged: Staged | None = None
    blocks: _Prefilled | None = None  # the engine's blocks once handed off (add)
    handoff_expected: bool = False  # begin_push ran and the engine has not handed off or failed yet
    waiter: Deferred | None = None  # the decode's AwaitPush
    waiter_until: float = float("inf")  # when that AwaitPush gets Pending if no outcome came (wait_ms)
    abandoned: bool = False  # the decode will not ask (it cancelled)
    outcome: Message | None = None
    busy: bool = False  # the push worker is inside a step of it
    layers_left: int = 0
    bytes: int = 0
    requests: int = 0
    t_last_layer: float = 0.0
    writes: list[Any] = field(default_factory=list)  # posted layer WRITEs not yet waited for
    failing: Message | None = None  # a failure found while the worker was busy with it: the worker ends it
    inline: bool = False  # layers are produced and posted on the forward's thread (stream-ordered transport)
    direct: DirectTarget | None = None  # layers are produced straight into the decode's memory (no staging, no WRITE)
    pending: list[int] = field(default_factory=list)  # inline: written layers not posted yet (a group fills)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def settled(self) -> bool:
        """Nothing more will happen to it: the entry can go."""
        return self.outcome is not None and (self.waiter is not None or self.abandoned) and not self.handoff_expected


class LayerFeed:
    """What the prefill engine calls during one request's last forward (``KVSender.begin_push``).

    On a CPU the push worker takes the layers only once the forward has written its last one: the
    forward already runs on every core (torch's intra-op threads), so a layer transformed beside it
    only oversubscribes them (SmolLM2, 256 tokens, 2 cores: TTFT +12 % against +1 % for a pull)."""

    def __init__(self, sender: KVSender, push: _Push):
        self._sender, self._push = sender, push
        self._held: list[int] | None = [] if sender.device.type != "cuda" else None

    def layer_written(self, layer: int, marker: Any = None) -> None:
        """Layer ``layer``'s KV is written (enqueued on the current stream, on CUDA, or once ``marker``,
        a CUDA event, completes): produce and send it beside the forward (on a CPU: after it)."""
        if self._push.inline:
            self._sender._push_layer_inline(self._push, layer, marker)
        elif self._held is not None:
            self._held.append(layer)
            if len(self._held) == self._sender.fmt.layout.num_layers:
                for held in self._held:
                    self._sender._enqueue(self._push, held, None)
        else:
            self._sender._enqueue(self._push, layer, marker if marker is not None else mark(self._sender.device))

    def failed(self, error: BaseException | str) -> None:
        """The forward (or the first token) failed: stop; the engine keeps and frees its blocks."""
        self._sender._engine_failed(self._push, str(error))


class KVSender:
    """The prefill instance's half of Algorithm 1 (P1-P9), served on a control socket."""

    def __init__(
        self,
        transport: Transport,
        fmt: SendFormat,
        config: str,
        host: str = "127.0.0.1",
        port: int = 0,
        ttl_s: float = 30.0,
        reap_every_s: float = 0.2,
        staging_wait_s: float = 5.0,
        destination_wait_s: float = 0.05,
        ledger: Callable[[], dict[str, Any]] | None = None,
        handoff_wait_s: float = 0.0,
    ):
        """``destination_wait_s``: how long ``begin_push`` waits for the destination of a request
        announced with :meth:`expect` (its decode hands over while the prefill starts). ``ledger``:
        what an Inspect is answered with (default: :meth:`ledger`), for owners that hold more.
        ``handoff_wait_s``: how long a D1 for a request not added yet waits for its :meth:`add`, for
        owners that tell the decode where the KV is before they hand it here (vLLM answers its client
        before its worker's next step hands over the blocks); 0: refused at once."""
        self._ledger = ledger or self.ledger
        self.handoff_wait_s = handoff_wait_s
        self.transport, self.fmt, self.config = transport, fmt, config
        self.ttl_s, self.staging_wait_s, self.destination_wait_s = ttl_s, staging_wait_s, destination_wait_s
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)  # a PushTo came (or an expectation ended)
        self._added = threading.Condition(self._lock)  # a prefilled request was added (handoff_wait_s)
        self._expected: dict[str, float] = {}  # request id -> deadline: its PushTo is on its way
        self._dropped: dict[str, float] = {}  # request id -> deadline: discarded before its forward began
        self._prefilled: dict[str, _Prefilled] = {}
        self._gone: collections.OrderedDict[str, tuple[str, float]] = collections.OrderedDict()  # recent ids no longer held: why, when
        self._sent: dict[str, _Sent] = {}
        self._receivers: dict[str, _Receiver] = {}
        self._drain: list[tuple[float, Held]] = []
        self._pushes: dict[str, _Push] = {}
        self._staging_queue: collections.deque[_StagingWait] = collections.deque()  # pulls waiting for room, in arrival order
        self._room = threading.Condition(self._lock)  # something released staging (or the queue changed)
        self.device = _device_of(fmt)
        self._side = SideStream(self.device)
        self._events = EventRecorder()  # landed pulls' "bytes are there" events, for decodes in other processes
        self._work: queue.SimpleQueue[tuple[_Push, int, Any]] = queue.SimpleQueue()
        for name, tensor in fmt.regions().items():
            transport.register(name, tensor)
        self._stop = threading.Event()
        self._pusher = threading.Thread(target=self._push_loop, name="hawk-kv-push", daemon=True)
        self._pusher.start()
        self._reaper = threading.Thread(target=self._reap_loop, args=(reap_every_s,), name="hawk-kv-reaper", daemon=True)
        self._reaper.start()
        self._stager = threading.Thread(target=self._stage_loop, name="hawk-kv-stager", daemon=True)
        self._stager.start()
        self.server = ControlServer(self._handle, host, port)

    @property
    def address(self) -> str:
        return self.server.address

    def add(self, request_id: str, num_tokens: int, block_ids: Sequence[int], release_blocks: Callable[[], None] | None = None) -> None:
        """Called after prefill: the request's KV is in ``block_ids`` and may be pulled until the TTL.

        A request being pushed layer-wise hands its blocks to its push instead (freed when the push
        ends); one whose destination came but whose push did not begin is pushed whole, now; one
        discarded while its destination waited for its forward gets its blocks back at once."""
        job = _Prefilled(num_tokens, np.array(block_ids, dtype=np.int64), release_blocks, time.monotonic() + self.ttl_s)
        with self._lock:
            self._expected.pop(request_id, None)  # its forward is over: a destination still to come is late
            dropped = self._dropped.pop(request_id, None) is not None
            push = self._pushes.get(request_id)
            if dropped:  # nobody will pull it or push it
                if push is not None:
                    push.handoff_expected = False
            else:
                if push is None and (request_id in self._prefilled or request_id in self._sent):
                    raise DuplicateRequest(f"request {request_id!r} already has KV waiting")
                if push is None:
                    self._prefilled[request_id] = job
                    self._gone.pop(request_id, None)
                    self._added.notify_all()
                    return
                if push.blocks is not None:
                    raise DuplicateRequest(f"request {request_id!r} already handed its blocks to its push")
                push.blocks, push.handoff_expected = job, False
            whole = not dropped and push.state is PushState.WAITING
            over = dropped or push.state in (PushState.PUSHED, PushState.FAILED)
        if whole:
            self._start_push(push, job, mark(self.device))
        elif over:
            self._give_back_blocks(job)
            if push is not None:
                self._settle(push)

    def discard(self, request_id: str) -> bool:
        """Drop a request nobody will pull (e.g. its client went away); frees its blocks, and fails
        its layer-wise push (the decode hears an Error and releases its side)."""
        with self._lock:
            job = self._prefilled.pop(request_id, None)
            if job is not None:
                self._forget(request_id, "discarded by the prefill")
            push = self._pushes.get(request_id)
            expected = self._expected.pop(request_id, None) is not None
            if expected or (push is not None and push.state is PushState.WAITING):
                # its forward may still come (a push begins at the forward's first layer): what it
                # hands off then comes straight back instead of waiting for a pull until the TTL
                self._dropped[request_id] = time.monotonic() + self.ttl_s
            self._arrived.notify_all()
        if job is not None:
            self._give_back_blocks(job)
        if push is not None:
            self._fail_push(push, f"request {request_id} was discarded by the prefill")
        return job is not None or push is not None or expected

    def expect(self, request_id: str) -> None:
        """The request's destination (PushTo) is on its way: its decode hands over while the prefill
        starts, so the hand-over's round trip is not on the request's critical path. ``begin_push``
        waits up to ``destination_wait_s`` for it (on CUDA the forward is already launched then);
        one that comes later gets the whole KV pushed after the forward, as any late destination."""
        with self._lock:
            self._expected[request_id] = time.monotonic() + self.ttl_s

    # -- the layer-wise flow (P1-P9 reordered; see the module docstring) -------------------------

    def begin_push(self, request_id: str, num_tokens: int, block_ids: Sequence[int]) -> LayerFeed | None:
        """P2: the request's last forward is about to run over ``block_ids``. With a destination
        waiting, returns the feed the engine reports each written layer to; else None (the KV goes
        the pull way, or is pushed whole if its destination comes later)."""
        with self._lock:
            if request_id in self._dropped:
                return None
            if request_id not in self._pushes and request_id in self._expected:
                self._arrived.wait_for(lambda: request_id in self._pushes or request_id not in self._expected,
                                       timeout=self.destination_wait_s)
            self._expected.pop(request_id, None)
            push = self._pushes.get(request_id)
            if push is None or push.state is not PushState.WAITING:
                return None
            push.state, push.handoff_expected = PushState.PUSHING, True
            push.deadline = time.monotonic() + self.ttl_s
            push.src_block_ids, push.num_tokens = list(block_ids), push.num_tokens
            if num_tokens != push.num_tokens:
                mismatch = f"request {request_id}: the decode expects {push.num_tokens} tokens, the prefill has {num_tokens}"
            else:
                mismatch = ""
        if not mismatch and self._plan_inline(push):
            return LayerFeed(self, push)
        self._work.put((push, -1, mismatch))
        return LayerFeed(self, push)

    def _plan_inline(self, push: _Push) -> bool:
        """Plan the push now, on the forward's thread, if its layers can be posted from there: a CUDA
        cache, a stream-ordered route to the decode, and staging free at once (no waiting here)."""
        mode = os.environ.get(INLINE_ENV, "1")
        if mode == "0" or (self.device.type != "cuda" and mode != "always"):
            return False
        try:
            if not self.transport.stream_ordered(push.receiver.peer):
                return False
            with self._lock:
                push.busy = True
            try:
                # on the side stream: what planning uploads (tables) must not queue behind the forward,
                # which a prefill graph has enqueued whole by the time its layers are reported
                with self._side.current():
                    self._plan_push(push, "", wait_s=0.0)
            finally:
                self._after_work(push)
        except BufferFull:
            return False  # the worker plans it, waiting for staging
        except Exception as e:  # noqa: BLE001 - this request's push fails; the forward goes on
            self._fail_push(push, f"request {push.request_id}: push failed: {type(e).__name__}: {e}")
            return True
        push.inline = push.staged is not None
        return push.inline or push.state is not PushState.PUSHING

    def _push_layer_inline(self, push: _Push, layer: int, marker: Any = None) -> None:
        """P3 + P5 on the forward's thread: layers are posted in groups (:func:`layer_group`), each
        group's transforms on the side stream after the group's kernels and one WRITE batch after
        them (the transport orders it on the device); nothing waits here. The worker waits for the
        writes once the last layer is posted. Why groups: each post costs host time on the forward's
        own thread, and the last group's device work (microseconds) is all that TTFT waits for."""
        with self._lock:
            if push.state is not PushState.PUSHING:
                return
            push.busy = True
        try:
            push.pending.append(layer)
            last = push.layers_left == len(push.pending)
            if len(push.pending) < layer_group(self.fmt.layout.num_layers) and not last:
                return
            layers, push.pending = push.pending, []
            staged = push.staged
            if staged is None:
                raise RuntimeError("layer pushed before its plan")
            t0 = time.perf_counter()
            with self._side.posting(marker):  # a group's last layer: its marker covers the earlier ones
                if push.direct is not None:
                    self.fmt.produce_layers_into(push.plan, layers, push.direct)
                    t1 = time.perf_counter()
                    self._count_direct(push, layers)
                else:
                    self.fmt.produce_layers(push.plan, layers, staged)
                    t1 = time.perf_counter()
                    self._post_writes(push, layers, staged)
            t2 = time.perf_counter()
            push.timings["post_transform_s"] = push.timings.get("post_transform_s", 0.0) + t1 - t0
            push.timings["post_write_s"] = push.timings.get("post_write_s", 0.0) + t2 - t1
            push.timings["posts"] = push.timings.get("posts", 0.0) + 1
            if push.layers_left == 0:
                push.t_last_layer = time.perf_counter()
                self._work.put((push, _ALL_POSTED, None))
        except Exception as e:  # noqa: BLE001 - this request's push fails; the forward goes on
            log.warning("layer-wise push of %s failed: %s", push.request_id, e)
            self._fail_push(push, f"request {push.request_id}: push failed: {type(e).__name__}: {e}")
        finally:
            self._after_work(push)

    def _push_to(self, msg: PushTo) -> Message:
        """P1: keep the destination. A request already prefilled (its D1 came late) is pushed whole."""
        with self._lock:
            receiver = self._receivers.get(msg.receiver)
            if receiver is None:
                return Error(msg.request_id, f"unknown receiver {msg.receiver!r}: say hello first")
            if msg.request_id in self._pushes or msg.request_id in self._sent:
                return Error(msg.request_id, f"request {msg.request_id!r} already has a destination")
            push = _Push(msg.request_id, receiver, [int(b) for b in msg.dst_block_ids], int(msg.num_tokens), time.monotonic() + self.ttl_s)
            self._pushes[msg.request_id] = push
            self._arrived.notify_all()
            late = self._prefilled.pop(msg.request_id, None)
        if late is not None:
            push.num_tokens = late.num_tokens
            with self._lock:
                push.blocks = late
            self._start_push(push, late, None)
        return Ack(msg.request_id)

    def _await_push(self, msg: AwaitPush) -> Message | Deferred:
        """D2's counterpart: the reply leaves when the push has an outcome."""
        with self._lock:
            push = self._pushes.get(msg.request_id)
            if push is None or push.receiver is not self._receivers.get(msg.receiver):
                return Error(msg.request_id, f"no layer-wise push of request {msg.request_id!r} for this receiver")
            waiter = push.waiter = Deferred()
            outcome = push.outcome
            if outcome is None:  # the decode still wants it: it lives another TTL (a long prefill queue)
                now = time.monotonic()
                push.deadline = max(push.deadline, now + self.ttl_s)
                push.waiter_until = now + msg.wait_ms / 1e3 if msg.wait_ms > 0 else float("inf")
        if outcome is not None:
            waiter.resolve(outcome)
            self._settle(push)
        return waiter

    def _start_push(self, push: _Push, job: _Prefilled, marker: Any) -> None:
        """Push a whole prefilled request (its destination came after its forward)."""
        with self._lock:
            if push.state is not PushState.WAITING:
                return
            push.state, push.src_block_ids = PushState.PUSHING, job.block_ids.tolist()
        self._work.put((push, -1, ""))
        for layer in range(self.fmt.layout.num_layers):
            self._work.put((push, layer, marker))

    def _enqueue(self, push: _Push, layer: int, marker: Any) -> None:
        if layer == self.fmt.layout.num_layers - 1:
            push.t_last_layer = time.perf_counter()
        self._work.put((push, layer, marker))

    def _engine_failed(self, push: _Push, error: str) -> None:
        with self._lock:
            push.handoff_expected = False
        self._fail_push(push, f"request {push.request_id}: prefill failed: {error}")
        self._settle(push)

    def _push_loop(self) -> None:
        """The push worker: plans, produces and writes layers in the order the engine finishes them.
        While it works on a push (``busy``) it alone may release that push's staging."""
        while not self._stop.is_set():
            try:
                push, layer, arg = self._work.get(timeout=0.1)
            except queue.Empty:
                continue
            with self._lock:
                if push.state is not PushState.PUSHING:
                    continue
                push.busy = True
            try:
                if layer == _ALL_POSTED:
                    self._finish_posted(push)
                elif layer < 0:
                    self._plan_push(push, arg)
                else:
                    self._push_layer(push, layer, arg)
            except Exception as e:  # noqa: BLE001 - this request fails; the worker goes on
                log.warning("layer-wise push of %s failed: %s", push.request_id, e)
                self._fail_push(push, f"request {push.request_id}: push failed: {type(e).__name__}: {e}")
            finally:
                self._after_work(push)

    def _after_work(self, push: _Push) -> None:
        """A push that ended while the worker held it: its staging goes back now (pushed) or after
        the transport's drain time (failed: a write may still read it)."""
        with self._lock:
            push.busy = False
            failing, push.failing = push.failing, None
        if failing is not None:
            self._end_push(push, PushState.FAILED, failing)
        with self._lock:
            staged = push.staged if push.state in (PushState.PUSHED, PushState.FAILED) else None
            if staged is not None:
                push.staged = None
                if push.state is PushState.FAILED:
                    self._drain.append((time.monotonic() + self.transport.drain_s, staged.held))
        if staged is not None and push.state is PushState.PUSHED:
            self.fmt.release(staged.held)

    def _plan_push(self, push: _Push, mismatch: str, wait_s: float | None = None) -> None:
        """P2-P4 of a push, beside the forward: plan it and reserve its staging (waiting up to
        ``wait_s`` for room, default ``staging_wait_s``), or none where the layers go straight
        into the decode's memory."""
        if mismatch:
            raise ValueError(mismatch)
        t0 = time.perf_counter()
        push.plan = self.fmt.plan_layers(push.num_tokens, push.src_block_ids, push.receiver.info, push.dst_block_ids)
        t1 = time.perf_counter()
        push.direct = self._direct_target(push)
        if push.direct is not None:
            staged = Staged(Held("direct"))  # P4 holds nothing: each layer's transform writes its pages
        else:
            staged = self._reserve_layers(push, wait_s)
        with self._lock:
            if push.state is not PushState.PUSHING:  # failed meanwhile: what was just reserved goes back
                self.fmt.release(staged.held)
                return
            push.staged = staged
        push.layers_left = self.fmt.layout.num_layers
        push.timings.update(plan_s=t1 - t0, reserve_s=time.perf_counter() - t1)

    def _reserve_layers(self, push: _Push, wait_s: float | None) -> Staged:
        """P4 of a push: its staging, waiting up to ``wait_s`` (default ``staging_wait_s``) for room."""
        deadline = time.monotonic() + (self.staging_wait_s if wait_s is None else wait_s)
        while True:
            try:
                return self.fmt.reserve_layers(push.plan, push.request_id, ttl_s=self.ttl_s * 2)
            except NeverFits:
                raise  # no release can make room: fail now, not after the wait
            except BufferFull:
                if time.monotonic() >= deadline or push.state is not PushState.PUSHING:
                    raise
                time.sleep(0.005)

    def _direct_target(self, push: _Push) -> DirectTarget | None:
        """Where the layers can be produced straight into the decode's memory: this process addresses
        it (the same GPU, in-process or through CUDA IPC) and the format can write it in one pass.
        ``$HAWK_DIRECT_WRITE=0`` keeps staging + WRITE (for comparison)."""
        memory = self._receiver_memory(push.receiver)
        return None if memory is None else self.fmt.direct_target(push.plan, memory)

    def _receiver_memory(self, r: _Receiver) -> Any:
        """The receiver's destination regions (the format's ``dest_regions``) as tensors this process can
        write (looked up once per receiver), or None: not addressable from here, or ``$HAWK_DIRECT_WRITE=0``."""
        if os.environ.get(DIRECT_ENV, "1") == "0":
            return None
        if not r.memory_known:
            names = self.fmt.dest_regions(r.info)
            r.memory = self.transport.peer_tensors(r.peer, names) if names else None
            r.memory_known = True
        return r.memory

    def _push_layer(self, push: _Push, layer: int, marker: Any) -> None:
        """P3 + P5 for one layer: produce it on the side stream, then WRITE it to the destination."""
        staged = push.staged
        if staged is None:
            raise RuntimeError("layer pushed before its plan")
        t0 = time.perf_counter()
        if push.direct is not None:  # produced straight into the destination: done when run returns
            self._side.run(marker, lambda: self.fmt.produce_layers_into(push.plan, [layer], push.direct))
            t1 = time.perf_counter()
            self._count_direct(push, [layer])
        else:
            self._side.run(marker, lambda: self.fmt.produce_layers(push.plan, [layer], staged))
            t1 = time.perf_counter()
            with self._side.current():  # ordered after this layer's transform, not the rest of the forward
                self._post_writes(push, [layer], staged)
        t2 = time.perf_counter()
        push.timings["transform_s"] = push.timings.get("transform_s", 0.0) + t1 - t0
        push.timings["write_s"] = push.timings.get("write_s", 0.0) + t2 - t1
        if push.layers_left == 0:
            self._finish_posted(push, wait_key="write_s")

    def _post_writes(self, push: _Push, layers: list[int], staged: Staged) -> None:
        """P5 for these layers (their bytes produced, or enqueued on the current stream before): one
        WRITE batch into the destination, not waited for; the layers count as posted."""
        parts = [self.fmt.layer_descs(push.plan, lyr, staged) for lyr in layers]
        descs = parts[0] if len(parts) == 1 else DescArray.concat(parts)  # one batch, no object per run
        if len(descs):
            push.writes.append(self.transport.submit("WRITE", push.receiver.peer, descs))
        push.bytes += desc_bytes(descs)
        push.requests += len(descs)
        push.layers_left -= len(layers)

    def _count_direct(self, push: _Push, layers: list[int]) -> None:
        """P5 done by P3 for these layers (enqueued on the side stream, current): they count as posted,
        complete when the side stream's work so far is (one mark per post, waited for like a WRITE)."""
        push.writes.append(self._side.written())
        push.bytes += len(layers) * push.plan.layer_bytes
        push.layers_left -= len(layers)

    def _finish_posted(self, push: _Push, wait_key: str | None = None) -> None:
        """Every layer is posted: wait for the writes (the layers' WRITEs overlap each other; only the
        last is waited for, its time added to ``wait_key``), then P6-P9 and P7."""
        t0 = time.perf_counter()
        self._wait_writes(push)
        t = time.perf_counter()
        if wait_key:
            push.timings[wait_key] = push.timings.get(wait_key, 0.0) + t - t0
        push.timings["exposed_s"] = t - push.t_last_layer if push.t_last_layer else 0.0
        self._end_push(push, PushState.PUSHED, Pushed(push.request_id, push.num_tokens, push.bytes, push.requests, dict(push.timings)))

    def _wait_writes(self, push: _Push) -> None:
        """Wait for (and release) every WRITE the push posted; the first failure raises after all are released."""
        writes, push.writes = push.writes, []
        try:
            for h in writes:
                if isinstance(h, DeviceWrite):
                    h.wait()
                else:
                    self.transport.wait(h, self.ttl_s)
        finally:
            for h in writes:
                if not isinstance(h, DeviceWrite):
                    self.transport.release(h)

    def _fail_push(self, push: _Push, message: str) -> None:
        self._end_push(push, PushState.FAILED, Error(push.request_id, message))

    def _end_push(self, push: _Push, state: PushState, outcome: Message) -> None:
        """P6 + P9 and P7: release what the push held, then give the decode its outcome (once).

        The outcome leaves only after every WRITE the push posted has ended: a failed push's decode
        frees (and may reuse) its destination blocks on hearing of it. A failure found while the
        worker is inside a step of the push is finished by the worker right after (``_after_work``)."""
        with self._lock:
            if push.state in (PushState.PUSHED, PushState.FAILED):
                return
            if state is PushState.FAILED and push.busy:
                push.failing = push.failing or outcome
                return
            push.state = state  # the worker takes no further step of it from here on
            writes, push.writes = push.writes, []
            job, push.blocks = push.blocks, None
        self._end_writes(writes)
        with self._lock:
            push.outcome = outcome
            push.deadline = time.monotonic() + self.ttl_s  # for an outcome nobody claims
            staged = None
            if not push.busy and push.staged is not None:  # else the worker releases it (_after_work)
                staged, push.staged = push.staged, None
                if state is PushState.FAILED:
                    self._drain.append((time.monotonic() + self.transport.drain_s, staged.held))
                    staged = None
            waiter = push.waiter
        if staged is not None:
            self.fmt.release(staged.held)
        if job is not None:
            self._give_back_blocks(job)
        if waiter is not None:
            waiter.resolve(outcome)
        self._settle(push)

    def _end_writes(self, writes: list[Any]) -> None:
        """Wait for the WRITEs a failing push left posted (errors included: they only have to end)."""
        for h in writes:
            if isinstance(h, DeviceWrite):
                h.wait()  # kernels writing into the decode's memory must end before it hears of the failure
                continue
            with contextlib.suppress(Exception):
                self.transport.wait(h, self.ttl_s)
            self.transport.release(h)

    def _settle(self, push: _Push) -> None:
        with self._lock:
            if push.settled and self._pushes.get(push.request_id) is push:
                del self._pushes[push.request_id]

    # -- control messages ---------------------------------------------------------------------

    def _handle(self, msg: Message, ident: bytes) -> Message | Deferred | None:
        if isinstance(msg, Hello):
            return self._hello(msg)
        if isinstance(msg, PullRequest):
            return self._pull(msg)
        if isinstance(msg, PushRequest):
            return self._push(msg)
        if isinstance(msg, PushTo):
            return self._push_to(msg)
        if isinstance(msg, AwaitPush):
            return self._await_push(msg)
        if isinstance(msg, Done):
            self._done(msg)
            return Ack(msg.request_id)
        if isinstance(msg, KeepAlive):
            self._keep_alive(msg)
            return None  # fire and forget
        if isinstance(msg, Inspect):
            return Holdings(self._ledger())
        return Error(getattr(msg, "request_id", ""), f"prefill does not handle {msg.TYPE!r} messages")

    def _hello(self, msg: Hello) -> Message:
        if msg.role != "decode":
            return Error("", f"expected a decode peer, got role {msg.role!r}")
        if msg.extra.get("format") != self.fmt.name:
            return Error("", f"decode expects send format {msg.extra.get('format')!r}; this prefill ({self.config}) sends {self.fmt.name!r}")
        layout = layout_from_wire(msg.layout)
        t0 = time.perf_counter()
        peer = self.transport.connect(msg.transport_md)
        if (took := time.perf_counter() - t0) > SLOW_HELLO_S:  # the decode waits for this answer under its pull timeout
            log.warning("hello from %s: connecting its %s transport took %.1f s", msg.extra.get("receiver"), self.transport.name, took)
        receiver = str(msg.extra.get("receiver") or uuid.uuid4().hex)
        info = _with_tuple_bases({"layout": layout, **msg.extra})
        with self._lock:
            self._receivers[receiver] = _Receiver(peer, info)
        extra = {**self.fmt.hello_extra(), "format": self.fmt.name, "receiver": receiver, "keepalive": True, "ttl_s": self.ttl_s,
                 "layerwise": self.fmt.layerwise, "pid": os.getpid(), "packed_ids": True}
        return Hello("prefill", self.config, self.transport.name, self.transport.metadata(), layout_to_wire(self.fmt.layout), extra)

    def _pull(self, msg: PullRequest) -> Message:
        # P1: receive the request.
        t0 = time.perf_counter()
        with self._lock:
            receiver = self._receivers.get(msg.receiver)
            gone = self._why_gone(msg.request_id)
            if receiver is not None and msg.request_id not in self._prefilled and gone is None and self.handoff_wait_s > 0:
                self._added.wait_for(lambda: msg.request_id in self._prefilled, timeout=self.handoff_wait_s)
            job = self._prefilled.pop(msg.request_id, None)  # P2: retrieve its KV
            if job is not None and receiver is not None:
                self._forget(msg.request_id, "pulled already")
        if receiver is None:
            if job is not None:
                self._restore(msg.request_id, job)
            return Error(msg.request_id, f"unknown receiver {msg.receiver!r}: say hello first")
        if job is None:
            why = gone or "never prefilled, expired, or pulled already"
            return Error(msg.request_id, f"no KV waiting for request {msg.request_id!r} ({why})")
        try:
            plan = self.fmt.plan(job.num_tokens, job.block_ids, receiver.info, msg.destination())
            t_plan = time.perf_counter()
            staged = self._land(plan, receiver, msg.ready_event_ok) if msg.land else None  # P3 + P5 into the decode's pages
            if staged is None and not self.fmt.fits_empty(plan):
                raise BufferFull(f"request {msg.request_id}: its {self.fmt.size(plan)} B never fit the prefill's staging")
            if staged is None:
                staged = self._stage_now(plan, msg.request_id)  # P3 + P4 + P5: reserve, transform into it
            if staged is None:  # staging is full (or others wait for it): answered by the stager
                return self._wait_for_room(_StagingWait(msg, job, plan, Deferred(), t0, t_plan, time.monotonic() + self.ttl_s))
        except BaseException as e:  # the request fails; nothing it held may stay held
            self._give_back_blocks(job)
            if isinstance(e, (ValueError, BufferFull)):
                return Error(msg.request_id, str(e))
            raise
        return self._ready(msg.request_id, job, plan, staged, t0, t_plan)

    def _ready(self, request_id: str, job: _Prefilled, plan: Any, staged: Staged, t0: float, t_plan: float) -> KVReady:
        """P6 + P7 of a pull whose bytes are staged (or landed): keep what D9 releases, answer with the metadata."""
        landed = staged.held.mode == "landed"
        keep = landed or self.fmt.reads_cache_in_place  # read after P7 (in place, or by a transform still running)
        if not keep:
            self._give_back_blocks(job)  # P6: the KV now lives in staging; the paged blocks can be reused
        with self._lock:
            self._sent[request_id] = _Sent(staged.held, job if keep else None, time.monotonic() + self.ttl_s)
        # P7: send metadata: where the bytes are and how many (and what this side's host work cost).
        timings = {"plan_s": t_plan - t0, **staged.timings}
        timings["handler_s"] = time.perf_counter() - t0
        if landed:  # nothing for the decode to pair: no block ids, no extents (1024 ids cost ~65 us to list and encode)
            return KVReady(request_id, self.fmt.name, job.num_tokens, [], "", 0, self.fmt.size(plan), [], [], timings,
                           landed=True, ready_event=staged.ready_event)
        return KVReady(
            request_id,
            self.fmt.name,
            job.num_tokens,
            job.block_ids.tolist(),
            staged.region,
            staged.offset,
            self.fmt.size(plan),
            self.fmt.extents(plan),
            staged.sources,
            timings,
        )

    def _land(self, plan: Any, receiver: _Receiver, event_ok: bool) -> Staged | None:
        """A pull whose decode lets this side write its pages (D1 ``land``), and that this process can
        address (the same GPU): the transform writes them, nothing is reserved or moved after. With
        ``event_ok`` (the decode waits on a CUDA IPC event) P7 leaves while the transform runs."""
        memory = self._receiver_memory(receiver)
        if memory is None:
            return None
        return self.fmt.land(plan, memory, self._events if event_ok else None)

    def _push(self, msg: PushRequest) -> Message:
        """Push variant of D5-D6: post the decode side's pairing as one WRITE batch from here."""
        with self._lock:
            receiver = self._receivers.get(msg.receiver)
            known = msg.request_id in self._sent
        if receiver is None or not known:
            return Error(msg.request_id, f"push for unknown receiver or request {msg.request_id!r}")
        try:
            descs = [Desc(*d) for d in msg.descs]
            self.transport.transfer("WRITE", receiver.peer, descs, timeout_s=self.ttl_s)
        except (ValueError, TypeError, TransferError) as e:
            return Error(msg.request_id, f"push failed: {e}")
        return Ack(msg.request_id)

    def _keep_alive(self, msg: KeepAlive) -> None:
        """The decode still has these requests queued: their un-pulled KV lives another TTL. Only a
        receiver that said hello may do this; requests already pulled or gone are ignored."""
        deadline = time.monotonic() + self.ttl_s
        with self._lock:
            if msg.receiver not in self._receivers:
                return
            for rid in msg.request_ids:
                job = self._prefilled.get(rid) if isinstance(rid, str) else None
                if job is not None:
                    job.deadline = max(job.deadline, deadline)

    def _done(self, msg: Done) -> None:
        # P8: receive the notice; P9: release what P4 reserved (and the blocks kept until now).
        with self._lock:
            push = self._pushes.get(msg.request_id)
            if push is not None:  # layer-wise: the decode gave up; stop writing, nobody will ask
                push.abandoned = True
        if push is not None:
            self._fail_push(push, f"request {msg.request_id}: cancelled by the decode: {msg.error}")
            self._settle(push)
            return
        self._cancel_waits(lambda w: f"request {w.msg.request_id}: cancelled by the decode: {msg.error}" if w.msg.request_id == msg.request_id else "")
        with self._lock:
            sent = self._sent.pop(msg.request_id, None)
        if sent is None:
            return
        if msg.ok:
            self.fmt.release(sent.held)
        else:  # the engine may still touch a failed batch's memory for a while
            with self._lock:
                self._drain.append((time.monotonic() + self.transport.drain_s, sent.held))
        if sent.held_blocks is not None:
            self._give_back_blocks(sent.held_blocks)
        with self._lock:
            self._room.notify_all()

    # -- reservations and expiry -------------------------------------------------------------

    def _stage_now(self, plan: Any, owner: str) -> Staged | None:
        """P3 + P4 + P5 if staging has room now and no earlier pull waits for it (arrival order: a large
        request is not overtaken forever by small ones); None otherwise."""
        with self._lock:
            if self._staging_queue:
                return None
        try:
            return self.fmt.stage(plan, owner, ttl_s=self.ttl_s)
        except BufferFull:
            return None

    def _wait_for_room(self, w: _StagingWait) -> Deferred:
        with self._lock:
            self._staging_queue.append(w)
            self._room.notify_all()
        return w.reply

    def _stage_loop(self) -> None:
        """The stager: the queue's head is staged as soon as releases make room for it; it alone
        touches a waiting pull's blocks while P3-P5 run (a D9 or the reaper meanwhile only marks it)."""
        while not self._stop.is_set():
            with self._lock:
                if not self._staging_queue:
                    if not self._stop.is_set():  # checked under the lock: close() notifies after setting it
                        self._room.wait()  # until a pull queues (or close)
                    continue
                w = self._staging_queue[0]
                w.staging = True
            staged: Staged | None = None
            error = ""
            t_try = time.perf_counter()
            try:
                staged = self.fmt.stage(w.plan, w.msg.request_id, ttl_s=self.ttl_s)
            except BufferFull:
                pass
            except Exception as e:  # noqa: BLE001 - this request fails; the stager goes on
                error = f"request {w.msg.request_id}: staging failed: {type(e).__name__}: {e}"
            with self._lock:
                w.staging = False
                done = bool(staged or error or w.cancelled)
                if done and self._staging_queue and self._staging_queue[0] is w:
                    self._staging_queue.popleft()
                if not done:
                    self._room.wait(0.05)  # until a release (or the poll: expiries do not notify)
                    continue
            if w.cancelled:
                if staged is not None:
                    self.fmt.release(staged.held)
                self._give_back_blocks(w.job)
                w.reply.resolve(Error(w.msg.request_id, w.cancelled))
            elif error:
                self._give_back_blocks(w.job)
                w.reply.resolve(Error(w.msg.request_id, error))
            else:
                assert staged is not None
                staged.timings["staging_queue_s"] = t_try - w.t_plan
                w.reply.resolve(self._ready(w.msg.request_id, w.job, w.plan, staged, w.t0, w.t_plan))

    def _cancel_waits(self, why: Callable[[_StagingWait], str]) -> int:
        """Drop queued pulls ``why`` names a reason for (its blocks back, its D1 answered with the reason);
        one the stager is inside is marked, and the stager finishes it."""
        with self._lock:
            marked = [(w, why(w)) for w in self._staging_queue]
            marked = [(w, r) for w, r in marked if r]
            for w, r in marked:
                w.cancelled = r
                if not w.staging:
                    self._staging_queue.remove(w)
            self._room.notify_all()
        for w, r in marked:
            if not w.staging:
                self._give_back_blocks(w.job)
                w.reply.resolve(Error(w.msg.request_id, r))
        return len(marked)

    def _give_back_blocks(self, job: _Prefilled) -> None:
        if job.release_blocks is not None:
            try:
                job.release_blocks()
            except Exception:  # noqa: BLE001 - a failing callback must not leak the rest
                log.exception("releasing prefill blocks failed")
            job.release_blocks = None

    def _restore(self, request_id: str, job: _Prefilled) -> None:
        with self._lock:
            self._prefilled[request_id] = job

    def _forget(self, request_id: str, why: str) -> None:
        """Remember why a request's KV is no longer held (caller holds the lock), so that a pull for it
        is refused at once with the reason instead of waiting ``handoff_wait_s`` for an add that
        will not come. Bounded: the oldest reasons go first."""
        self._gone[request_id] = (why, time.monotonic())
        self._gone.move_to_end(request_id)
        while len(self._gone) > GONE_REMEMBERED:
            self._gone.popitem(last=False)

    def _why_gone(self, request_id: str) -> str | None:
        """Why a request's KV is no longer held, and how long ago (caller holds the lock): how long before a
        pull says whose clock ran out, a slow decode's or a TTL too short. None: held, or never known."""
        if request_id in self._prefilled or request_id not in self._gone:
            return None
        why, at = self._gone[request_id]
        return f"{why}, {time.monotonic() - at:.1f} s before this pull"

    def reap(self, now: float | None = None) -> int:
        """Release everything past its deadline; returns how many holds were released."""
        now = time.monotonic() if now is None else now
        with self._lock:
            stale_jobs = [k for k, j in self._prefilled.items() if j.deadline <= now]
            jobs = [self._prefilled.pop(k) for k in stale_jobs]
            for k in stale_jobs:
                self._forget(k, f"expired: not pulled within the TTL of {self.ttl_s:g} s")
            stale_sent = [k for k, s in self._sent.items() if s.deadline <= now]
            sent = [self._sent.pop(k) for k in stale_sent]
            ready = [r for t, r in self._drain if t <= now]
            self._drain = [(t, r) for t, r in self._drain if t > now]
            stale_pushes = [p for p in self._pushes.values() if p.deadline <= now]
            for table in (self._expected, self._dropped):  # their prefill never began, or never ended
                for rid in [r for r, t in table.items() if t <= now]:
                    del table[rid]
            asked_again = []  # AwaitPushes that waited their wait_ms without an outcome
            for p in self._pushes.values():
                if p.outcome is None and p.waiter is not None and p.waiter_until <= now:
                    asked_again.append((p.request_id, p.waiter))
                    p.waiter, p.waiter_until = None, float("inf")
        for rid, waiter in asked_again:
            waiter.resolve(Pending(rid))
        for p in stale_pushes:  # never reached, stuck, or its outcome never claimed
            p.abandoned = p.abandoned or p.outcome is not None
            self._fail_push(p, f"request {p.request_id}: the layer-wise push expired (ttl {self.ttl_s:g} s)")
            self._settle(p)
        for j in jobs:
            self._give_back_blocks(j)
        for s in sent:
            self.fmt.release(s.held)
            if s.held_blocks is not None:
                self._give_back_blocks(s.held_blocks)
        for h in ready:
            self.fmt.release(h)
        expired = self.fmt.expire(now)
        waited = self._cancel_waits(lambda w: f"request {w.msg.request_id}: staging stayed full for {self.ttl_s:g} s" if w.deadline <= now else "")
        return len(jobs) + len(sent) + len(ready) + len(expired) + len(stale_pushes) + waited

    def _reap_loop(self, every_s: float) -> None:
        due = time.monotonic() + every_s
        while not self._stop.wait(max(0.0, due - time.monotonic())):
            due = self._reap_tick(due, every_s)

    def _reap_tick(self, due: float, every_s: float, now: float | None = None) -> float:
        """One round of the reaper, woken at ``now`` for ``due``; returns the next round's time. A round
        that wakes more than :data:`STALL_S` late first moves the deadlines that wait on decodes by the
        delay: this process did not run, so neither did the threads that take their keep-alives and D9s,
        and a TTL measures the decode's silence, not this process's."""
        now = time.monotonic() if now is None else now
        if now - due > STALL_S:
            self._postpone(now - due)
        try:
            self.reap(now)
        except Exception:  # noqa: BLE001
            log.exception("KV reaper failed")
        return max(now, time.monotonic()) + every_s  # from the round's end: a long round is no stall

    def _postpone(self, stalled_s: float) -> None:
        with self._lock:
            held = [*self._prefilled.values(), *self._sent.values(), *self._pushes.values()]
            for h in held:
                h.deadline += stalled_s
        if held:
            log.warning("this process stalled for %.1f s: %d KV holds waiting on decodes get as much longer", stalled_s, len(held))

    def accounting(self) -> dict[str, Any]:
        """What the prefill side holds right now, and for whom."""
        with self._lock:
            return {
                "staging": self.fmt.live(),
                "waiting": sorted(self._prefilled),
                "staging_queue": [w.msg.request_id for w in self._staging_queue],
                "in_flight": sorted(self._sent),
                "draining": len(self._drain),
                "pushes": sorted(self._pushes),
                "expected": sorted(self._expected),
            }

    def ledger(self) -> dict[str, Any]:
        """:meth:`accounting` as plain data (what travels in Holdings): counts and request ids."""
        a = self.accounting()
        return {**a, "staging": len(a["staging"]), "staging_bytes": sum(r.size for r in a["staging"])}

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            pushes = list(self._pushes.values())
        for p in pushes:  # the decodes hear it (if the socket still carries it) and release
            p.abandoned, p.handoff_expected = True, False
            self._fail_push(p, f"request {p.request_id}: the prefill is shutting down")
        self._pusher.join(timeout=5)
        self._cancel_waits(lambda w: f"request {w.msg.request_id}: the prefill is shutting down")
        self.server.close()
        self._reaper.join(timeout=2)
        self._stager.join(timeout=5)
        with self._lock:
            jobs = list(self._prefilled.values()) + [s.held_blocks for s in self._sent.values() if s.held_blocks]
            held = [s.held for s in self._sent.values()] + [h for _, h in self._drain]
            held += [p.staged.held for p in pushes if p.staged is not None]
            self._prefilled.clear()
            self._sent.clear()
            self._drain.clear()
            self._pushes.clear()
        for j in jobs:
            self._give_back_blocks(j)
        for h in held:
            self.fmt.release(h)


# ============================================================================ decode side


@dataclass
class PullResult:
    request_id: str
    num_tokens: int
    bytes: int
    requests: int
    mode: str
    timings: dict[str, float] = field(default_factory=dict)


    def host_breakdown_ms(self) -> dict[str, float]:
        """Where the pull's time went, in ms (see :data:`BREAKDOWN`); keys missing from ``timings``
        (an older sender, a pull made elsewhere) are left out."""
        return {k: self.timings[k] * 1e3 for k in BREAKDOWN if k in self.timings}


#: The host-side breakdown of one pull, in order. ``control_s`` is the D1-D2 round trip less the
#: sender's handler (the messages themselves); the ``sender_*`` steps run inside that round trip;
#: ``total_s`` runs from D1 to the KV in the cache (after D7); release and notify come after it. A decode
#: instance adds ``connect_s``, the handshake with a prefill it had not met (near 0 after its first
#: pull), and its ``total_s`` then starts before it.
BREAKDOWN: tuple[str, ...] = (
    "connect_s", "send_s", "plan_overlap_s", "control_s", "sender_plan_s", "sender_reserve_s", "sender_transform_s",
    "sender_transform_wait_s", "sender_other_s", "plan_s", "reserve_s", "descs_s", "submit_s", "transfer_wait_s",
    "finish_s", "release_s", "notify_s", "total_s",
)


class _Clock:
    """Laps of one pull: ``lap(name)`` books the time since the previous lap under ``name``."""

    def __init__(self) -> None:
        self.t0 = self.now = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        t = time.perf_counter()
        self.laps[name] = self.laps.get(name, 0.0) + t - self.now
        self.now = t


def _sender_time(ready: Any, key: str) -> float:
    v = ready.timings.get(key, 0.0) if isinstance(getattr(ready, "timings", None), dict) else 0.0
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 else 0.0


def _pull_timings(t: _Clock, t_stored: float, ready: Any) -> dict[str, float]:
    """The pull's laps plus the sender's own steps, and the legacy coarse keys (ready/pair/transfer/finish)."""
    lap = t.laps
    handler = min(_sender_time(ready, "handler_s"), lap.get("wait_ready_s", 0.0))
    sender = {f"sender_{k}": _sender_time(ready, f"{k}_s") for k in ("plan", "staging_queue", "reserve", "transform", "transform_wait")}
    sender = {k + "_s": v for k, v in sender.items()}
    inside = sum(sender.values())
    if inside > handler > 0:  # D1 reached the sender while this side still planned ahead: the handler
        sender = {k: v * handler / inside for k, v in sender.items()}  # overlapped the wait; scale to what was waited
    out = {k: v for k, v in lap.items() if k != "wait_ready_s"}
    out.update(sender)
    out["sender_other_s"] = max(0.0, handler - sum(sender.values()))
    out["control_s"] = lap.get("wait_ready_s", 0.0) - handler
    out["total_s"] = t_stored - t.t0
    out["ready_s"] = lap.get("send_s", 0.0) + lap.get("plan_overlap_s", 0.0) + lap.get("wait_ready_s", 0.0)
    out["pair_s"] = lap.get("plan_s", 0.0) + lap.get("reserve_s", 0.0) + lap.get("descs_s", 0.0)
    out["transfer_s"] = lap.get("submit_s", 0.0) + lap.get("transfer_wait_s", 0.0)
    return out


def _engine_of(transport: Transport, peer: str) -> str:
    """The engine that carries batches with ``peer`` (auto's choice for that peer, else the transport's own)."""
    return transport.engine_for(peer) if hasattr(transport, "engine_for") else transport.name


def _with_tuple_bases(info: dict[str, Any]) -> dict[str, Any]:
    """A peer's handshake with its NPU tensor bases (when it has them) as a tuple of ints: converted
    once here, not on every plan (``check_request`` takes a tuple as it is)."""
    bases = info.get("bases")
    if isinstance(bases, list):
        try:
            info["bases"] = tuple(int(b) for b in bases)
        except (TypeError, ValueError) as e:
            raise ProtocolError(f"malformed tensor bases in handshake: {e}") from e
    return info


@dataclass
class _Sender:
    client: ControlClient
    peer: str
    info: dict[str, Any]  # the sender's handshake: its layout and extras (e.g. NPU tensor bases)
    receiver: str
    next_keepalive: float = 0.0  # monotonic time before which no KeepAlive is sent again
    #: Whether a pull that lets it land is expected to be landed (then no plan is made while D1 is in
    #: flight: nothing here would use it). First a device copy's route, then what its last such D2 said.
    lands: bool = False


class KVReceiver:
    """The decode instance's half of Algorithm 1 (D1-D9)."""

    HISTORY = 512  # pull results kept for :meth:`result`

    def __init__(self, transport: Transport, landing: Landing, config: str, post: str = "pull", timeout_s: float = 30.0):
        if post not in ("pull", "push"):
            raise ValueError(f"post must be 'pull' or 'push', got {post!r}")
        self.transport, self.landing, self.config, self.post, self.timeout_s = transport, landing, config, post, timeout_s
        for name, tensor in landing.regions().items():
            transport.register(name, tensor)
        self._senders: dict[str, _Sender] = {}
        self._connecting: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self._draining: list[tuple[float, Held]] = []
        self._history: dict[str, PullResult] = {}
        self._expecting: dict[str, float] = {}  # layer-wise destinations handed out, by request
        self._cancelled: dict[str, str] = {}  # ... cancelled while their D1 was on its way: why
        self._events = EventWaiter()  # senders' CUDA IPC events (landed pulls answered early), opened once
        self._room = RoomQueue()  # D3s waiting for receive-buffer room, in arrival order
        for ledger in landing.ledgers():
            ledger.subscribe(self._room.notify)

    def connect(self, address: str) -> None:
        """Handshake with a prefill instance: exchange transport metadata and KV layouts."""
        with self._lock:
            if address in self._senders:
                return
            gate = self._connecting.setdefault(address, threading.Lock())
        with gate:  # one handshake per address, however many pulls start at once
            with self._lock:
                if address in self._senders:
                    return
            try:
                self._handshake(address)
            except PeerUnreachable as e:
                raise KVTransferFailed(f"prefill at {address} did not answer the handshake: {e}") from e

    def _handshake(self, address: str) -> None:
        client = ControlClient(address)
        layout, extra = self.landing.hello()
        hello = Hello("decode", self.config, self.transport.name, self.transport.metadata(), layout_to_wire(layout), {**extra, "format": self.landing.format, "receiver": self.transport.agent_name})
        try:
            reply = client.call(hello, self.timeout_s)
            if isinstance(reply, Error):
                raise KVTransferFailed(f"prefill at {address} refused the handshake: {reply.message}")
            if not isinstance(reply, Hello) or reply.extra.get("format") != self.landing.format:
                raise ProtocolError(f"prefill at {address} answered the handshake with {reply!r:.200}")
            peer = self.transport.connect(reply.transport_md)
            info = _with_tuple_bases({**reply.extra, "layout": layout_from_wire(reply.layout), "device_copy": self._device_copy(peer)})
            info["event_device"] = self._event_device(peer, info)
        except BaseException:
            client.close()
            raise
        with self._lock:
            self._senders[address] = _Sender(client, peer, info, str(reply.extra["receiver"]), lands=bool(info["device_copy"]))

    def _device_copy(self, peer: str) -> bool:
        """Whether batches with ``peer`` are copies inside one GPU: a same-host engine (local or
        cuda-ipc, not paced to a link) and every CUDA region on both sides on one device. The landing
        then plans with a device copy's costs (``ChannelLanding.device_cost``), not a link's."""
        t = self.transport
        if isinstance(t, PacedTransport):
            return False
        if _engine_of(t, peer) not in ("local", "cuda-ipc"):
            return False
        regions = [*t.regions().values(), *t.remote_regions(peer).values()]
        return all(r.device == "cuda" for r in regions) and len({r.device_id for r in regions}) == 1

    def _event_device(self, peer: str, info: dict[str, Any]) -> int | None:
        """The GPU on which this side can wait for the sender's CUDA IPC events (a landed pull then
        answers before its transform ends), or None: not a device copy through CUDA IPC between two
        processes, a sender that does not say its process, or ``$HAWK_IPC_EVENTS=0`` (for comparison)."""
        if os.environ.get(IPC_EVENTS_ENV, "1") == "0":
            return None
        t = self.transport
        pid = info.get("pid")
        if not info["device_copy"] or _engine_of(t, peer) != "cuda-ipc" or not isinstance(pid, int) or pid == os.getpid():
            return None
        return next(r.device_id for r in t.regions().values() if r.device == "cuda")

    def peer_layout(self, address: str) -> Any:
        """The KV layout the prefill at ``address`` announced (its ``head_start`` and heads tell a
        tensor-parallel decode rank whether this sender holds any of its heads)."""
        self.connect(address)
        return self._senders[address].info["layout"]

    def keep_alive(self, address: str, request_ids: Sequence[str]) -> bool:
        """Ask the prefill at ``address`` to keep these queued requests' KV for another TTL; sent
        at most about four times per TTL per prefill, and only if its handshake offered it.
        Returns whether a message went out."""
        self.connect(address)
        s = self._senders[address]
        if not s.info.get("keepalive") or not request_ids:
            return False
        now = time.monotonic()
        ttl = float(s.info.get("ttl_s") or 0.0)
        with self._lock:
            if now < s.next_keepalive:
                return False
            s.next_keepalive = now + ttl / 4
        s.client.send(KeepAlive(s.receiver, [str(r) for r in request_ids]))
        return True

    def pull(
        self, address: str, request_id: str, dst_block_ids: Sequence[int], timeout_s: float | None = None, num_tokens: int | None = None
    ) -> PullResult:
        """Bring request ``request_id``'s KV from the prefill at ``address`` into ``dst_block_ids``.

        ``num_tokens`` (the prompt's length, when the caller knows it) lets this side plan while D1 is
        in flight; without it the plan is built after D2, as before. Either way the sender's metadata
        decides: a wrong hint costs only the overlap. Where the sender is expected to land the pull
        (``_Sender.lands``) nothing is planned ahead: a landed pull needs no plan here, and one the
        sender declines is planned after D2.
        """
        timeout = self.timeout_s if timeout_s is None else timeout_s
        self.reap()
        self.connect(address)
        s = self._senders[address]
        t = _Clock()
        # D1: ask for the KV (and plan this side while the request is in flight).   D2: receive the metadata.
        try:
            land = self.landing.takes_landed()
            event_ok = land and s.info.get("event_device") is not None
            pending = s.client.start(self._pull_request(s, request_id, dst_block_ids, land, event_ok))
            t.lap("send_s")
            if num_tokens is not None and not (land and s.lands):
                self._warm(num_tokens, dst_block_ids, s.info)
            t.lap("plan_overlap_s")
            ready = pending.result(timeout)
            t_ready = time.monotonic()
        except PeerUnreachable as e:
            with contextlib.suppress(Exception):  # a slow prefill (staging full) drops the request then; a dead one hears nothing
                s.client.send(Done(request_id, False, f"no answer to D1 within {timeout:g} s"))
            raise KVTransferFailed(f"request {request_id}: prefill at {address} did not answer: {e}") from e
        t.lap("wait_ready_s")
        if isinstance(ready, Error):
            raise KVTransferFailed(f"request {request_id}: prefill refused: {ready.message}")
        held: Held | None = None
        descs: Sequence[Desc] = []
        ok, error = False, ""
        try:
            if not isinstance(ready, KVReady) or ready.request_id != request_id or ready.format != self.landing.format:
                raise ProtocolError(f"request {request_id}: unexpected reply {ready!r:.200}")
            if land:
                s.lands = ready.landed  # the next pull plans ahead only if this one was not landed
            if ready.landed:  # the prefill wrote the pages itself (it may only if D1 said so): D3-D6 hold nothing
                if not self.landing.takes_landed():
                    raise ProtocolError(f"request {request_id}: the prefill wrote the pages, which this decode did not allow")
                if ready.ready_event:  # still being written: wait for the prefill's event first
                    self._wait_event(s, request_id, ready.ready_event)
                    t.lap("transfer_wait_s")
                self.landing.finish_layers()  # D7: visible to this side's kernels
                t.lap("finish_s")
            else:
                plan = self.landing.plan(ready, dst_block_ids, s.info)
                t.lap("plan_s")
                held = self._reserve(s, plan, request_id, self._room_deadline(s, t_ready, timeout))  # D3
                t.lap("reserve_s")
                descs = self.landing.pair(plan, held, ready)  # D4
                t.lap("descs_s")
                self._move(s, request_id, descs, timeout, t)  # D5 + D6
                self.landing.finish(plan, held)  # D7
                t.lap("finish_s")
            ok = True
        except (TransferError, PeerUnreachable) as e:
            error = f"request {request_id}: transfer failed: {e}"
            raise KVTransferFailed(error) from e
        except (ProtocolError, ValueError, MemoryError) as e:
            error = f"request {request_id}: {e}"
            raise KVTransferFailed(error) from e
        finally:
            t_stored = t.now
            if held is not None:  # D8: release per-channel reservations (later, if a batch may be in flight)
                if ok:
                    self.landing.release(held)
                else:
                    with self._lock:
                        self._draining.append((time.monotonic() + self.transport.drain_s, held))
            t.lap("release_s")
            s.client.send(Done(request_id, ok, error))  # D9: the prefill may release (P8-P9); one message, no reply
            t.lap("notify_s")
        timings = _pull_timings(t, t_stored, ready)
        if ready.landed:
            result = PullResult(request_id, ready.num_tokens, ready.total_bytes, 0, "landed", timings)
        else:
            result = PullResult(request_id, ready.num_tokens, desc_bytes(descs), len(descs), held.mode if held else "", timings)
        self._remember(result)
        return result

    def _reserve(self, s: _Sender, plan: Any, request_id: str, deadline: float) -> Held:
        """D3. A request whose KV fits the empty receive buffers waits for room (in arrival order,
        until ``deadline``) instead of failing: concurrent pulls fragment a first-fit buffer, so the
        bytes can be free in total but in no one range, or held by transfers about to end. One that
        never fits fails at once (:class:`NeverFits`)."""
        if not self.landing.needs_room(plan, request_id, s.info):
            return self.landing.reserve(plan, request_id, ttl_s=None, peer=s.info)
        return self._room.take(lambda: self.landing.reserve(plan, request_id, ttl_s=None, peer=s.info), request_id, deadline, tick=self.reap)

    @staticmethod
    def _room_deadline(s: _Sender, t_ready: float, timeout: float) -> float:
        """How long D3 may wait for room, from D2: the pull's timeout, and at most half the sender's
        TTL, which bounds how long it keeps the staged bytes after D2 (the rest is left for D5-D6)."""
        ttl = s.info.get("ttl_s")
        wait = min(timeout, float(ttl) / 2) if isinstance(ttl, (int, float)) and ttl > 0 else timeout
        return t_ready + wait

    @staticmethod
    def _pull_request(s: _Sender, request_id: str, dst_block_ids: Sequence[int], land: bool, event_ok: bool) -> PullRequest:
        """D1's message: the destination packed for a prefill that reads it so (one copy each side instead of
        an int per block; its handshake says ``packed_ids``), listed for an older one."""
        if s.info.get("packed_ids"):
            return PullRequest(request_id, s.receiver, [], land, event_ok, pack_ids(dst_block_ids))
        return PullRequest(request_id, s.receiver, [int(b) for b in dst_block_ids], land, event_ok)

    def _wait_event(self, s: _Sender, request_id: str, handle: bytes) -> None:
        """D7 of a landed pull answered early: until the sender's CUDA IPC event has fired."""
        device = s.info.get("event_device")
        if device is None:
            raise ProtocolError(f"request {request_id}: the prefill sent a CUDA event, which this decode did not allow")
        try:
            self._events.wait(handle, device)
        except RuntimeError as e:  # a handle that does not open, or a device error while waiting
            raise TransferError(f"waiting on the prefill's CUDA IPC event: {e}") from e

    def cancel_push(self, address: str, request_id: str, why: str) -> bool:
        """Stop a layer-wise push this receiver is waiting for (its request was aborted): D9 not ok,
        so the prefill stops writing and :meth:`push_to` ends at once with :class:`PushFailed`
        instead of waiting for the forward. False when no such push is in flight."""
        with self._lock:
            s = self._senders.get(address)
            expecting = request_id in self._expecting
            if expecting:  # its D1 may not have arrived yet (Done could overtake it): push_to checks after the Ack
                self._cancelled[request_id] = why
        if s is None or not expecting:
            return False
        s.client.send(Done(request_id, False, why))
        return True

    def push_to(
        self,
        address: str,
        request_id: str,
        dst_block_ids: Sequence[int],
        num_tokens: int,
        timeout_s: float | None = None,
        on_handed: Callable[[], None] | None = None,
    ) -> PullResult:
        """The layer-wise flow's decode side: hand ``dst_block_ids`` to the prefill at ``address``
        (D1) before it prefills request ``request_id``, and return once every layer has been pushed
        (D2) and is visible (D7). ``on_handed`` is called as D1 leaves, not when its Ack comes back:
        the caller starts the prefill then, which ``expect``s the destination (``KVSender.expect``),
        so the Ack's way back is not on the request's critical path. A refused D1 fails the request
        here (the caller hears it and aborts the prefill, whose wait for the destination then ends).

        ``timeout_s`` bounds each wait for the prefill: its Ack, and each ask for the push's outcome.
        The outcome may take as long as the prefill's queue: the prefill answers Pending after a
        while and is asked again, which also keeps the push alive there (an ask within the TTL). On
        any failure the prefill is told to stop (D9 not ok) and :class:`PushFailed` says how long
        the blocks may still be written.
        """
        timeout = self.timeout_s if timeout_s is None else timeout_s
        self.reap()
        self.connect(address)
        s = self._senders[address]
        if not s.info.get("layerwise") or not self.landing.layerwise:
            raise KVTransferFailed(f"request {request_id}: {self.config} between this decode and the prefill at {address} has no layer-wise push (kv_flow=layerwise supports gn-hawk and gg-direct)")
        t = _Clock()
        with self._lock:
            self._expecting[request_id] = time.monotonic()
        ok, error, handed = False, "", False
        try:
            if on_handed is not None:
                on_handed()
            try:
                ack = s.client.call(PushTo(request_id, s.receiver, [int(b) for b in dst_block_ids], int(num_tokens)), timeout)  # D1
            except PeerUnreachable as e:
                error = f"request {request_id}: prefill at {address} did not take the destination: {e}"
                raise PushFailed(error, self.transport.drain_s) from e
            if isinstance(ack, Error):
                error = f"request {request_id}: prefill refused the destination: {ack.message}"
                raise KVTransferFailed(error)
            if not isinstance(ack, Ack):
                error = f"request {request_id}: unexpected reply {ack!r:.200}"
                raise KVTransferFailed(error)
            t.lap("send_s")
            handed = True
            with self._lock:
                why = self._cancelled.pop(request_id, None)
            if why is not None:  # cancelled while D1 was on its way (cancel_push's D9 may have overtaken it)
                error = f"request {request_id}: cancelled by the decode: {why}"
                handed = False  # this D9 is answered, so the push is over when this returns
                with contextlib.suppress(PeerUnreachable):
                    s.client.call(Done(request_id, False, error), timeout)
                raise PushFailed(error, self.transport.drain_s)
            # D2: the push's outcome. Asked again on each Pending, so the wait is as long as the
            # prefill's queue while each ask is bounded (and keeps the push alive on the prefill)
            wait_ms = int(1e3 * min(timeout / 2, float(s.info.get("ttl_s") or timeout) / 3))
            reply: Message = Pending(request_id)
            while isinstance(reply, Pending):
                try:
                    reply = s.client.call(AwaitPush(request_id, s.receiver, wait_ms), timeout)
                except PeerUnreachable as e:
                    error = f"request {request_id}: no push outcome from {address}: {e}"
                    raise PushFailed(error, self.transport.drain_s) from e
            t.lap("wait_pushed_s")
            if isinstance(reply, Error):
                error = f"request {request_id}: push failed: {reply.message}"
                raise PushFailed(error, self.transport.drain_s)
            if not isinstance(reply, Pushed) or reply.request_id != request_id:
                error = f"request {request_id}: unexpected reply {reply!r:.200}"
                raise PushFailed(error, self.transport.drain_s)
            self.landing.finish_layers()  # D7: the written pages become the KV cache
            t.lap("finish_s")
            ok = True
        finally:
            with self._lock:
                self._expecting.pop(request_id, None)
                self._cancelled.pop(request_id, None)
            if not ok and handed:  # D9: stop pushing; release what it holds
                s.client.send(Done(request_id, False, error))
        timings = {**t.laps, "total_s": t.now - t.t0}
        timings.update({f"sender_{k}": float(v) for k, v in reply.timings.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        result = PullResult(request_id, reply.num_tokens, reply.bytes, reply.requests, "layerwise", timings)
        self._remember(result)
        return result

    def _warm(self, num_tokens: int, dst_block_ids: Sequence[int], info: dict[str, Any]) -> None:
        """Receiver planning overlapped with the D1 round trip; never fails the pull (D2 re-checks all)."""
        try:
            self.landing.warm(int(num_tokens), dst_block_ids, info)
        except Exception:  # noqa: BLE001 - a bad hint only loses the overlap
            log.debug("planning ahead of D2 failed", exc_info=True)

    def _remember(self, result: PullResult) -> None:
        with self._lock:
            self._history[result.request_id] = result
            while len(self._history) > self.HISTORY:
                self._history.pop(next(iter(self._history)))

    def result(self, request_id: str) -> PullResult | None:
        """The last :class:`PullResult` of ``request_id`` (the last few hundred pulls are kept), with its
        host-side breakdown: how benchmarks read what a pull cost when an engine made it."""
        with self._lock:
            return self._history.get(request_id)

    def _move(self, s: _Sender, request_id: str, descs: Sequence[Desc], timeout: float, t: _Clock) -> None:
        if self.post == "pull":
            h = self.transport.submit("READ", s.peer, descs)
            t.lap("submit_s")
            try:
                self.transport.wait(h, timeout)
            finally:
                self.transport.release(h)
            t.lap("transfer_wait_s")
            return
        flipped = [[d.remote_region, d.remote_offset, d.local_region, d.local_offset, d.length] for d in descs]
        t.lap("submit_s")
        reply = s.client.call(PushRequest(request_id, s.receiver, flipped), timeout)
        t.lap("transfer_wait_s")
        if isinstance(reply, Error):
            raise TransferError(reply.message)

    def reap(self, now: float | None = None) -> None:
        """Release reservations of failed pulls once the engine can no longer touch them."""
        now = time.monotonic() if now is None else now
        with self._lock:
            ready = [h for t, h in self._draining if t <= now]
            self._draining = [(t, h) for t, h in self._draining if t > now]
        for h in ready:
            self.landing.release(h)

    def accounting(self) -> dict[str, Any]:
        with self._lock:
            draining = len(self._draining)
            expecting = sorted(self._expecting)
        return {"reservations": self.landing.live(), "draining": draining, "expecting": expecting, "waiting_for_room": self._room.waiting()}

    def close(self) -> None:
        with self._lock:
            senders = list(self._senders.values())
            self._senders.clear()
            held = [h for _, h in self._draining]
            self._draining.clear()
        self._room.close("the receiver closed")  # pulls waiting at D3 fail now (nothing held yet)
        for s in senders:
            s.client.close()
        for h in held:
            self.landing.release(h)
        self.landing.close()
