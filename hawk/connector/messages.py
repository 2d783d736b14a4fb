"""Control messages of Algorithm 1, versioned and validated on receipt.

Every message is a msgpack map ``{"v": VERSION, "type": ..., fields...}``. Decoding checks the
version, the type and every field's type, so a malformed or mismatched peer is rejected with a
message that says what was wrong, before any memory is touched.

When the cluster has a secret, every frame also carries an HMAC-SHA256 tag of its correlation id
and payload under that secret (``sign`` / ``verify``); a frame whose tag is missing or wrong is
refused before it is decoded, so an unauthenticated peer can change nothing.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, get_type_hints

import msgpack
import numpy as np

from hawk.layouts.gpu import GpuKVLayout
from hawk.layouts.npu import Bank, NpuArch, NpuKVLayout
from hawk.layouts.paged import PagedKVLayout

VERSION = 1


class ProtocolError(ValueError):
    """A control message that is malformed, of another version, or inconsistent with the plan."""


class AuthError(ProtocolError):
    """A control frame without a valid tag for this cluster's secret."""


def sign(secret: bytes | None, corr: bytes, payload: bytes) -> bytes:
    """The frame's tag: HMAC-SHA256 of correlation id and payload (empty without a secret)."""
    if not secret:
        return b""
    return hmac.new(secret, corr + payload, hashlib.sha256).digest()


def verify(secret: bytes | None, corr: bytes, tag: bytes, payload: bytes) -> None:
    """Raises AuthError unless ``tag`` is this frame's tag (anything goes without a secret)."""
    if secret and not hmac.compare_digest(tag, sign(secret, corr, payload)):
        raise AuthError("missing or wrong cluster secret on the control channel" if tag else "unauthenticated control message (this cluster needs its secret)")


def pack_ids(ids: Sequence[int] | np.ndarray) -> bytes:
    """Block ids as little-endian int64 bytes. Why: a D1 names every destination block (1024 for a 16k-token
    gg-direct pull), and as a msgpack list each id was converted, packed, unpacked and converted again,
    one Python int at a time on each side; as bytes each side does one copy."""
    arr = np.asarray(ids, dtype="<i8")
    if arr.ndim != 1:
        raise ValueError(f"block ids must be a flat list, got shape {arr.shape}")
    return arr.tobytes()


def unpack_ids(blob: bytes) -> np.ndarray:
    """:func:`pack_ids` reversed: a writable int64 array (a length that is not whole ids is refused)."""
    if len(blob) % 8:
        raise ProtocolError(f"packed block ids must be a multiple of 8 bytes, got {len(blob)}")
    return np.frombuffer(blob, dtype="<i8").astype(np.int64)


@dataclass(frozen=True)
class Message:
    TYPE: ClassVar[str] = ""


@dataclass(frozen=True)
class Hello(Message):
    """Handshake, both ways: who I am, how to reach my memory, what my KV layout is."""

    TYPE: ClassVar[str] = "hello"
    role: str  # "prefill" | "decode"
    config: str
    transport: str
    transport_md: bytes
    layout: dict  # layout_to_wire(...)
    extra: dict = field(default_factory=dict)  # e.g. the NPU cache's tensor bases, the send format


@dataclass(frozen=True)
class PullRequest(Message):
    """D1: the decode side asks for one request's KV and says where it will live."""

    TYPE: ClassVar[str] = "pull"
    request_id: str
    receiver: str
    dst_block_ids: list
    # The sender may write the KV straight into those blocks' pages where it can address them (same GPU):
    # then its KVReady says ``landed``. Optional with a default, so older peers interoperate: no bump.
    land: bool = False
    # This decode (another process on the same GPU) can wait on a CUDA IPC event: a landed KVReady may
    # leave before the transform ends, naming the event (KVReady.ready_event). Optional: no bump.
    ready_event_ok: bool = False
    # ``dst_block_ids`` packed (:func:`pack_ids`), with ``dst_block_ids`` left empty: sent only to a prefill
    # whose handshake offers ``packed_ids`` (an older one would plan with no blocks), so no bump.
    dst_ids: bytes = b""

    def destination(self) -> list | np.ndarray:
        """The destination block ids, whichever field carries them (both at once is refused: ambiguous)."""
        if not self.dst_ids:
            return self.dst_block_ids
        if self.dst_block_ids:
            raise ProtocolError(f"pull {self.request_id}: destination block ids given both listed and packed")
        return unpack_ids(self.dst_ids)


@dataclass(frozen=True)
class KVReady(Message):
    """P7: the KV is in the sender's registered memory; here is where and how much."""

    TYPE: ClassVar[str] = "ready"
    request_id: str
    format: str
    num_tokens: int
    src_block_ids: list
    region: str
    offset: int
    total_bytes: int
    extents: list  # [[channel, offset, length], ...] for NPU tiles, [] otherwise
    sources: list = field(default_factory=list)  # [[region, offset, length], ...] when spread over regions
    # The sender's host seconds per step (plan_s, reserve_s, transform_s, transform_wait_s, handler_s):
    # the decode side subtracts handler_s from its round trip to get the control cost. Optional with a
    # default, so a peer that predates it interoperates (decode ignores keys it does not know): no bump.
    timings: dict = field(default_factory=dict)
    # The KV is already in the decode's pages (PullRequest.land): nothing to move, only D7. Optional (no bump).
    landed: bool = False
    # With ``landed``: the IPC handle of a CUDA event that fires once the bytes are there (only where D1
    # said ready_event_ok); D7 waits on it. Empty: they are there already. Optional (no bump).
    ready_event: bytes = b""


@dataclass(frozen=True)
class PushRequest(Message):
    """Push variant of D5: the decode side pairs regions, the prefill side posts the WRITE batch."""

    TYPE: ClassVar[str] = "push"
    request_id: str
    receiver: str
    descs: list  # [[local_region, local_offset, remote_region, remote_offset, length], ...] from the sender's view


@dataclass(frozen=True)
class PushTo(Message):
    """D1 of the layer-wise flow, sent before the prefill runs: where request ``request_id``'s KV
    must land (the decode has already allocated ``dst_block_ids``). The prefill keeps it as a
    pending destination and answers Ack at once; it then writes each layer there as its forward
    finishes it. Sent only to a prefill whose handshake advertised ``layerwise`` (so no version bump)."""

    TYPE: ClassVar[str] = "push-to"
    request_id: str
    receiver: str
    dst_block_ids: list
    num_tokens: int


@dataclass(frozen=True)
class AwaitPush(Message):
    """Decode -> prefill after PushTo's Ack: reply when the pushed KV is all there (Pushed) or
    will not be (Error). The reply is held by the prefill until then."""

    TYPE: ClassVar[str] = "await-push"
    request_id: str
    receiver: str
    wait_ms: int = 0  # > 0: answer Pending after this long without an outcome (0: hold the reply)


@dataclass(frozen=True)
class Pending(Message):
    """Prefill -> decode, the reply to an AwaitPush that set ``wait_ms``: no outcome yet (the
    request is still queued for prefill, or its layers are in flight); ask again. Each AwaitPush
    keeps the push alive for another TTL, so a long prefill queue delays a push instead of
    expiring it, while a decode that stops asking lets the TTL release it. Only a decode that sets
    ``wait_ms`` gets it, and an older prefill ignores the field: no version bump."""

    TYPE: ClassVar[str] = "pending"
    request_id: str


@dataclass(frozen=True)
class Pushed(Message):
    """The layer-wise flow's D2: every layer of the request has been written to its destination
    and the writes have completed. ``timings``: the sender's seconds (``exposed_s``: from the
    last layer's forward to the last write done, the part of the transfer prefill did not hide)."""

    TYPE: ClassVar[str] = "pushed"
    request_id: str
    num_tokens: int
    bytes: int
    requests: int
    timings: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Done(Message):
    """D9: the decode side is finished with the request (ok or not); the sender may release (P8-P9)."""

    TYPE: ClassVar[str] = "done"
    request_id: str
    ok: bool
    error: str = ""


@dataclass(frozen=True)
class KeepAlive(Message):
    """Decode -> prefill, no reply: these requests are queued on the decode side, waiting for its KV
    memory; keep their KV (extend their TTL) rather than expire it. Sent only to a prefill whose
    handshake advertised ``keepalive`` (so an older prefill never sees this type: no version bump)."""

    TYPE: ClassVar[str] = "keepalive"
    receiver: str
    request_ids: list


@dataclass(frozen=True)
class Ack(Message):
    TYPE: ClassVar[str] = "ack"
    request_id: str = ""


@dataclass(frozen=True)
class Error(Message):
    TYPE: ClassVar[str] = "error"
    request_id: str
    message: str


@dataclass(frozen=True)
class Inspect(Message):
    """Anyone with the cluster secret -> a KV control socket: what do you hold now? (operators, tests).
    Only a peer that knows this type is asked (a test, an operator's tool): no version bump."""

    TYPE: ClassVar[str] = "inspect"


@dataclass(frozen=True)
class Holdings(Message):
    """The answer to Inspect: the side's ledger as plain numbers, lists and strings."""

    TYPE: ClassVar[str] = "holdings"
    ledger: dict


MESSAGES: dict[str, type[Message]] = {
    m.TYPE: m
    for m in (Hello, PullRequest, KVReady, PushRequest, PushTo, AwaitPush, Pending, Pushed, Done, KeepAlive, Ack, Error,
              Inspect, Holdings)
}
_PY_TYPES = {str: str, int: int, bool: bool, bytes: bytes, list: list, dict: dict}


def encode(msg: Message) -> bytes:
    """The message as msgpack. Fields are read as they are (no ``dataclasses.asdict``: it copies every
    list element by element, which made a KVReady of 1024 block ids cost ~1 ms of host time; no field
    holds a dataclass)."""
    body = {"v": VERSION, "type": msg.TYPE}
    for name in _field_names(type(msg)):
        body[name] = getattr(msg, name)
    return msgpack.packb(body, use_bin_type=True)


@functools.lru_cache(maxsize=None)
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))



@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    """A message class's field types, resolved once: get_type_hints costs ~20 us a call, and every
    control message is decoded twice per round trip."""
    return get_type_hints(cls)

def decode(blob: bytes) -> Message:
    try:
        body = msgpack.unpackb(blob, raw=False)
    except Exception as e:  # noqa: BLE001 - anything unparsable is a protocol error
        raise ProtocolError(f"control message is not valid msgpack: {e}") from e
    if not isinstance(body, dict):
        raise ProtocolError(f"control message must be a map, got {type(body).__name__}")
    if body.get("v") != VERSION:
        raise ProtocolError(f"control message version {body.get('v')!r}, this side speaks {VERSION}")
    cls = MESSAGES.get(body.get("type"))  # type: ignore[arg-type]
    if cls is None:
        raise ProtocolError(f"unknown control message type {body.get('type')!r}")
    kwargs: dict[str, Any] = {}
    for name, want, required in _schema(cls):
        if name not in body:
            if not required:
                continue
            raise ProtocolError(f"{cls.TYPE} message lacks field {name!r}")
        v = body[name]
        if not isinstance(v, want) or (want is int and isinstance(v, bool)):
            raise ProtocolError(f"{cls.TYPE}.{name} must be {want.__name__}, got {type(v).__name__} {v!r:.60}")
        kwargs[name] = v
    return cls(**kwargs)


@functools.lru_cache(maxsize=None)
def _schema(cls: type) -> tuple[tuple[str, type, bool], ...]:
    """A message class's fields as ``(name, Python type on the wire, required)``, worked out once: every
    control message is decoded on the hot path, and asking ``dataclasses.fields`` and each field's
    default again per message is host time the decode's checks do not need."""
    hints = _hints(cls)
    return tuple((f.name, _PY_TYPES[hints[f.name]], f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)  # type: ignore[misc]
                 for f in dataclasses.fields(cls))


# -- layouts on the wire ---------------------------------------------------------------------


#: Version of the ``paged`` layout kind's fields (a hierarchical layout, e.g. vLLM's caches).
PAGED_WIRE_VERSION = 1
_PAGED_FIELDS = ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim", "dtype", "head_start", "name")


def layout_to_wire(layout: GpuKVLayout | NpuKVLayout | PagedKVLayout) -> dict:
    if isinstance(layout, PagedKVLayout):
        d: dict = {f: getattr(layout, f) for f in _PAGED_FIELDS}
        d.update(kind="paged", version=PAGED_WIRE_VERSION, kv_base=list(layout.kv_base), tensor_shape=list(layout.tensor_shape),
                 tensor_strides=list(layout.tensor_strides), modes=[[[list(p) for p in m] for m in km] for km in layout.modes])
        return d
    d = dataclasses.asdict(layout)
    d["kind"] = "gpu" if isinstance(layout, GpuKVLayout) else "npu"
    return d


def _paged_from_wire(d: dict) -> PagedKVLayout:
    """A ``paged`` layout, every part type-checked here and the description by the constructor."""
    version = d.pop("version", None)
    if version != PAGED_WIRE_VERSION:
        raise ProtocolError(f"paged layout version {version!r}, this side reads {PAGED_WIRE_VERSION}")
    want = set(_PAGED_FIELDS) | {"kv_base", "tensor_shape", "tensor_strides", "modes"}
    if set(d) != want:
        raise ProtocolError(f"paged layout fields {sorted(d)}, expected {sorted(want)}")
    ints = [*d["kv_base"], *d["tensor_shape"], *d["tensor_strides"]] if all(isinstance(d[k], list) for k in ("kv_base", "tensor_shape", "tensor_strides")) else [None]
    modes = d["modes"]
    shaped = isinstance(modes, list) and len(modes) == 2 and all(
        isinstance(km, list) and len(km) == 4 and all(isinstance(m, list) and m and all(isinstance(p, list) and len(p) == 2 for p in m) for m in km)
        for km in modes)
    if not shaped:
        raise ProtocolError(f"paged layout modes must be 2 x 4 lists of [shape, stride] pairs, got {modes!r:.120}")
    ints += [v for km in modes for m in km for p in m for v in p]
    if any(isinstance(v, bool) or not isinstance(v, int) for v in ints) or not isinstance(d["name"], str):
        raise ProtocolError("paged layout offsets, shapes and strides must be ints (and its name a str)")
    return PagedKVLayout(
        num_layers=d["num_layers"], num_blocks=d["num_blocks"], block_size=d["block_size"], num_kv_heads=d["num_kv_heads"],
        head_dim=d["head_dim"], dtype=d["dtype"], head_start=d["head_start"], name=d["name"], kv_base=tuple(d["kv_base"]),
        tensor_shape=tuple(d["tensor_shape"]), tensor_strides=tuple(d["tensor_strides"]),
        modes=tuple(tuple(tuple(tuple(p) for p in m) for m in km) for km in modes))  # type: ignore[arg-type]


def layout_from_wire(d: dict) -> GpuKVLayout | NpuKVLayout | PagedKVLayout:
    try:
        d = dict(d)
        kind = d.pop("kind")
        if kind == "gpu":
            return GpuKVLayout(**d)
        if kind == "npu":
            a = d.pop("arch")
            arch = NpuArch(a["name"], tuple(Bank(**b) for b in a["banks"]), a["alignment"])
            return NpuKVLayout(arch=arch, **d)
        if kind == "paged":
            return _paged_from_wire(d)
    except ProtocolError:
        raise
    except Exception as e:  # noqa: BLE001 - constructor validation errors become protocol errors
        raise ProtocolError(f"malformed layout in handshake: {e}") from e
    raise ProtocolError(f"unknown layout kind {kind!r}")
