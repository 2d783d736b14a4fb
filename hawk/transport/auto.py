""""auto": one transport that picks, per peer, the fastest engine that can reach it.

Why: NIXL (UCX) between two processes on ONE GPU falls back to a slow path (about 0.4 GB/s measured
on an H200, READ and WRITE alike) where a device copy moves about 2 TB/s. The same-host engines of
``local.py`` do a device copy. "auto" wraps them and a network engine, and decides at connect():

===============================================  ==========================================
the peer is                                       its batches go through
===============================================  ==========================================
in this process                                   "local": torch copies on a side stream
on this host, another process, with CUDA regions  "cuda-ipc": peer copies through CUDA IPC
                                                  (batches touching the peer's *host*
                                                  regions: the network engine)
anywhere else (or no CUDA region on this host)    the network engine (NIXL by default)
===============================================  ==========================================

"This host" is a robust identity, not the hostname alone: hostname, kernel boot id and the IPC and
PID namespaces (two containers on one machine only count as one host when CUDA IPC and the pid
liveness check can work between them). "This process" is a random per-process token plus the pid
(a forked child is another process). cuda-ipc is further chosen only where every GPU index the peer's
CUDA regions use names the same physical GPU here (UUIDs compared: CUDA_VISIBLE_DEVICES may differ).
If the preferred engine cannot connect (IPC handles that do not open, say), the next one is tried and
the reason logged. The choice is logged once per peer at INFO and kept: :meth:`engine_for`.

Costs, paid once: every region is registered with every inner engine (the same-host one only makes a
byte view; NIXL's registration costs what the "nixl" transport costs). Each metadata() call exports
fresh CUDA IPC handles (local.py: publish one blob per peer, as the connector does); a peer on another
host never opens them. The network engine (one NIXL agent with its progress thread) exists whenever
one is installed, as with "nixl"; a same-host peer is also connected to it (both sides then know each
other on every engine, whichever way each decided, and the peer's host regions stay reachable).

Forcing: the names "nixl", "mooncake", "local", "cuda-ipc" still make exactly those transports.
``make_transport("auto", force="cuda-ipc")`` (or "local", "network", or the network engine's name)
keeps auto's metadata but connects every peer with that engine only (ConnectError where it cannot).

Semantics are the base class's: the same TransferHandle, error classes and buffer-reuse rule; a batch
is handed, validated, to the chosen engine's hooks (no second validation or handle). ``drain_s`` is the
largest of the inner engines'.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from hawk.transport.base import (
    ConnectError,
    RegionInfo,
    SegArray,
    Segment,
    Status,
    TransferHandle,
    Transport,
    TransportError,
    TransportUnavailable,
    _Peer,
    used_regions,
)
from hawk.transport.local import CudaIpcTransport, LocalTransport

log = logging.getLogger(__name__)

AUTO_VERSION = 1
#: Network engines tried, in order, when ``network="default"``.
DEFAULT_NETWORK = ("nixl", "mooncake")
#: Env var that overrides the host identity (tests; or to keep two hosts' processes apart by hand).
HOST_ID_ENV = "HAWK_TRANSPORT_HOST_ID"
_PROCESS_TOKEN = secrets.token_hex(8)  # with the pid: "this process" (a fork keeps the token, not the pid)


def host_identity() -> str:
    """What two processes must share for CUDA IPC between them: hostname, boot id, IPC and PID namespaces."""
    env = os.environ.get(HOST_ID_ENV)
    if env:
        return env
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
    except OSError:
        parts.append(f"node-{uuid.getnode():012x}")
    for ns in ("ipc", "pid"):
        try:
            parts.append(os.readlink(f"/proc/self/ns/{ns}"))
        except OSError:
            parts.append(f"{ns}:?")
    return "|".join(parts)


def gpu_identities(init: bool) -> list[str] | None:
    """UUID of every visible GPU by torch index; None when unknown (no CUDA, or not initialised and
    ``init`` is False: a metadata() call must not create a CUDA context in a CPU-only process)."""
    if not torch.cuda.is_available() or not (init or torch.cuda.is_initialized()):
        return None
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        u = getattr(p, "uuid", None)
        out.append(str(u) if u is not None else f"{os.environ.get('CUDA_VISIBLE_DEVICES', '*')}#{i}:{p.name}")
    return out


@dataclass
class _Route:
    """How one peer is reached: the chosen engine and the inner links (engine object, inner peer id)."""

    engine: str  # "local" | "cuda-ipc" | the network engine's name
    reason: str
    links: dict[str, tuple[Transport, str]]  # "near" / "net" -> (inner transport, its peer id)
    primary: str  # key of ``links`` that carries the peer's batches
    host_regions: frozenset[str] = frozenset()  # cuda-ipc: the peer's host regions (go over "net")
    fallback: str | None = None  # the engine that carries batches the primary cannot (host regions)


@dataclass(eq=False)
class _Routed:
    """engine_state of an outer handle: the inner engine, its name, and the inner handle it works on."""

    engine: Transport
    name: str
    handle: TransferHandle = field(repr=False)


def _for_engine(eng: Transport, segs: Sequence[Segment]) -> Sequence[Segment]:
    """``segs`` as ``eng``'s hooks take them: a SegArray only where the engine takes arrays."""
    return list(segs) if isinstance(segs, SegArray) and not eng.takes_arrays else segs


class AutoTransport(Transport):
    """Picks local / cuda-ipc / the network engine per peer at connect(); see the module docstring."""

    name = "auto"
    takes_arrays = True  # hands them on to the engine that takes them, as Segments to the others

    def __init__(
        self,
        agent_name: str | None = None,
        network: str | None = "default",
        network_options: dict[str, Any] | None = None,
        force: str | None = None,
        host_id: str | None = None,
    ) -> None:
        """``network``: the engine for peers elsewhere ("default": NIXL, else Mooncake, else none; a name
        must be available; None: none). ``force``: "local", "cuda-ipc", "network" or the network engine's
        name connects every peer with that engine alone. ``host_id`` replaces :func:`host_identity`."""
        if force not in (None, "local", "cuda-ipc", "network", *DEFAULT_NETWORK):
            raise ValueError(f"force={force!r}: choose local, cuda-ipc, network or a network engine's name")
        super().__init__(agent_name)
        self.force = force
        self.host_id = host_id or host_identity()
        self._near: LocalTransport | None = None
        self._net: Transport | None = None
        self._net_missing: set[str] = set()  # regions the network engine refused to register
        self._by_engine: dict[str, int] = {}
        self._told: dict[str, str] = {}  # peer agent -> engine we logged for it
        self._drain = 0.0
        try:
            if force in (None, "local", "cuda-ipc"):
                want_ipc = force != "local" and torch.cuda.is_available()
                if force == "cuda-ipc" and not want_ipc:
                    raise TransportUnavailable("auto(force='cuda-ipc') needs CUDA, and torch.cuda.is_available() is False")
                cls = CudaIpcTransport if want_ipc else LocalTransport
                self._near = cls(f"{self.agent_name}~near")
            if force not in ("local", "cuda-ipc"):
                self._net = self._make_network(network, network_options or {}, force)
        except BaseException:
            self._close_inner()
            raise
        self._drain = max([0.0, *(e.drain_s for e in self._inner())])  # engines fix theirs at construction

    def _make_network(self, network: str | None, options: dict[str, Any], force: str | None) -> Transport | None:
        from hawk.transport.registry import make_transport

        if force in DEFAULT_NETWORK:
            if network not in ("default", force):
                raise ValueError(f"force={force!r} but network={network!r}")
            network = force
        if network is None:
            if force == "network":
                raise ValueError("force='network' needs a network engine (network=None)")
            return None
        names = DEFAULT_NETWORK if network == "default" else (network,)
        if network != "default" and network not in DEFAULT_NETWORK:
            raise ValueError(f"network={network!r}: choose one of {', '.join(DEFAULT_NETWORK)}, 'default' or None")
        why = []
        for n in names:
            try:
                return make_transport(n, agent_name=f"{self.agent_name}~net", **options)
            except (TransportUnavailable, TransportError) as e:  # not installed, or would not start here
                if network != "default" or force == "network":
                    raise
                if not isinstance(e, TransportUnavailable):
                    log.warning("auto transport %s: %s did not start (%s)", self.agent_name, n, e)
                why.append(f"{n}: {e}")
        log.info("auto transport %s: no network engine (%s); peers on other hosts cannot be reached",
                 self.agent_name, "; ".join(why))  # fmt: skip
        return None

    # ----------------------------------------------------------------------------------- queries
    @property
    def engines(self) -> dict[str, str]:
        """The inner engines: {"near": "local" | "cuda-ipc", "net": "nixl" | "mooncake"} (those that exist)."""
        return {k: e.name for k, e in (("near", self._near), ("net", self._net)) if e is not None}

    @property
    def network(self) -> str | None:
        return self._net.name if self._net is not None else None

    @property
    def drain_s(self) -> float:  # type: ignore[override]
        """The longest any inner engine may keep touching memory after a failed batch."""
        return self._drain

    def engine_for(self, peer: str) -> str:
        """The engine that carries ``peer``'s batches: "local", "cuda-ipc", "nixl" or "mooncake"."""
        with self._lock:
            return self._peer(peer).state.engine

    def route(self, peer: str) -> dict[str, Any]:
        """engine_for plus why, and the engine (if any) that carries batches touching the peer's host regions."""
        with self._lock:
            r: _Route = self._peer(peer).state
            return {"engine": r.engine, "reason": r.reason, "fallback": r.fallback, "host_regions": sorted(r.host_regions)}

    def routes(self) -> dict[str, str]:
        """peer id -> engine, for every connected peer."""
        with self._lock:
            return {pid: p.state.engine for pid, p in self._peers.items()}

    def batches_by_engine(self) -> dict[str, int]:
        """Batches submitted so far, by the engine that carried them (reset with reset_stats)."""
        with self._lock:
            return dict(self._by_engine)

    def reset_stats(self) -> None:
        super().reset_stats()
        self._by_engine = {}

    # ----------------------------------------------------------------------------------- regions
    def _inner(self) -> list[Transport]:
        return [e for e in (self._near, self._net) if e is not None]

    def _engine_register(self, info: RegionInfo, tensor: torch.Tensor) -> Any:
        held: list[Transport] = []
        try:
            if self._near is not None:
                self._near.register(info.name, tensor)
                held.append(self._near)
            if self._net is not None:
                try:
                    self._net.register(info.name, tensor)
                    held.append(self._net)
                except (ValueError, TransportError) as e:
                    if self._near is None:
                        raise
                    # Same-host peers can still use the region; the network engine will refuse batches on it.
                    log.warning("auto transport %s: %s cannot register region %r (%s); only same-host peers reach it",
                                self.agent_name, self._net.name, info.name, e)  # fmt: skip
                    self._net_missing.add(info.name)
        except BaseException:
            for e in held:
                try:
                    e.deregister(info.name)
                except Exception:  # noqa: BLE001 - undoing a half registration, best effort
                    pass
            raise
        return held

    def _engine_deregister(self, info: RegionInfo, token: Any) -> None:
        self._net_missing.discard(info.name)
        first: Exception | None = None
        for e in token:
            try:
                e.deregister(info.name)
            except Exception as ex:  # noqa: BLE001 - deregister from every engine, then report
                first = first or ex
        if first is not None:
            raise first

    # ------------------------------------------------------------------------------------- peers
    def _engine_metadata(self) -> bytes:
        doc = {
            "v": AUTO_VERSION,
            "host": self.host_id,
            "proc": _PROCESS_TOKEN,
            "gpus": gpu_identities(init=any(r.info.device == "cuda" for r in self._regions.values())),
            "near": [self._near.name, self._near.metadata()] if self._near is not None else None,
            "net": [self._net.name, self._net.metadata()] if self._net is not None else None,
        }
        return msgpack.packb(doc, use_bin_type=True)

    @staticmethod
    def _peer_md(doc: dict[str, Any]) -> dict[str, Any]:
        try:
            md = msgpack.unpackb(doc["engine_md"], raw=False)
            ok = isinstance(md, dict) and md.get("v") == AUTO_VERSION and isinstance(md.get("host"), str)
            for k in ("near", "net"):
                v = md.get(k) if ok else None
                ok = ok and (v is None or (isinstance(v, list) and len(v) == 2 and isinstance(v[0], str)
                                           and isinstance(v[1], bytes)))  # fmt: skip
        except Exception as e:  # noqa: BLE001 - any decode error means malformed metadata
            raise ConnectError(f"auto: malformed engine metadata from {doc.get('agent')!r} ({type(e).__name__}: {e})") from e
        if not ok:
            raise ConnectError(f"auto: malformed engine metadata from {doc.get('agent')!r} (auto version {AUTO_VERSION})")
        return md

    def _candidates(self, doc: dict[str, Any], md: dict[str, Any], regions: dict[str, RegionInfo]) -> tuple[list[tuple[str, str]], str]:
        """Engines to try for this peer, best first, each with why; and why the better ones were not."""
        near, net = md.get("near"), md.get("net")
        same_host = md["host"] == self.host_id
        same_proc = same_host and md.get("proc") == _PROCESS_TOKEN and doc.get("pid") == os.getpid()
        out: list[tuple[str, str]] = []
        skipped: list[str] = []
        if same_proc:
            if self._near is not None and near is not None:
                out.append(("local", "same process"))
            else:
                skipped.append("local: not on both sides")
        elif same_host:
            cuda = sorted({r.device_id for r in regions.values() if r.device == "cuda"})
            if not isinstance(self._near, CudaIpcTransport) or near is None or near[0] != "cuda-ipc":
                skipped.append("cuda-ipc: not on both sides (needs CUDA)")
            elif not cuda:
                skipped.append("cuda-ipc: the peer has no CUDA region")
            else:
                mine, theirs = gpu_identities(init=True) or [], md.get("gpus") or []
                bad = [d for d in cuda if d >= len(mine) or d >= len(theirs) or mine[d] != theirs[d]]
                if bad:
                    skipped.append(f"cuda-ipc: the peer's GPU index(es) {bad} are other GPUs here (CUDA_VISIBLE_DEVICES)")
                else:
                    out.append(("cuda-ipc", f"same host, another process, CUDA regions on GPU {cuda}"))
        else:
            skipped.append(f"same-host engines: the peer is on host {md['host'].split('|')[0]!r} (another host id)")
        if self._net is not None and net is not None and net[0] == self._net.name:
            if not same_host:
                why = "another host"
            elif same_proc:
                why = "same process, " + ("; ".join(skipped) or "if local fails")
            else:
                why = "same host, another process, " + ("; ".join(skipped) or "if cuda-ipc fails")
            out.append((self._net.name, why))
        else:
            have = self._net.name if self._net is not None else None
            skipped.append(f"network: this side has {have!r}, the peer {net[0] if net else None!r}")
        if self.force is not None:
            want = self._net.name if self.force == "network" and self._net is not None else self.force
            out = [(e, f"forced ({why})") for e, why in out if e == want]
        return out, "; ".join(skipped)

    def _link(self, engine: str, md: dict[str, Any], regions: dict[str, RegionInfo]) -> _Route:
        if engine == "local":
            assert self._near is not None
            return _Route("local", "", {"near": (self._near, self._near.connect(md["near"][1]))}, "near")
        if engine == "cuda-ipc":
            assert self._near is not None
            links = {"near": (self._near, self._near.connect(md["near"][1]))}
            host = frozenset(n for n, r in regions.items() if r.device != "cuda")
            fallback = None
            if self._net is not None and md.get("net") is not None and md["net"][0] == self._net.name and self.force is None:
                try:  # best effort: the peer's host regions, and the peer may have chosen the network engine
                    links["net"] = (self._net, self._net.connect(md["net"][1]))
                    fallback = self._net.name
                except ConnectError as e:
                    log.warning("auto transport %s: %s could not connect a same-host peer (%s); its host regions "
                                "are unreachable", self.agent_name, self._net.name, e)  # fmt: skip
            return _Route("cuda-ipc", "", links, "near", host, fallback)
        assert self._net is not None and engine == self._net.name
        return _Route(engine, "", {"net": (self._net, self._net.connect(md["net"][1]))}, "net")

    def _engine_connect(self, doc: dict[str, Any], regions: dict[str, RegionInfo], known: _Peer | None) -> _Peer:
        md = self._peer_md(doc)
        agent = doc["agent"]
        candidates, skipped = self._candidates(doc, md, regions)
        errors = []
        route = None
        for engine, why in candidates:
            try:
                route = self._link(engine, md, regions)
                route.reason = why
                break
            except ConnectError as e:
                errors.append(f"{engine}: {e}")
                log.warning("auto transport %s: %s could not connect peer %r (%s); trying the next engine",
                            self.agent_name, engine, agent, e)  # fmt: skip
        if route is None:
            forced = f" (forced: {self.force})" if self.force else ""
            raise ConnectError(f"auto: no engine reaches peer {agent!r}{forced}: " + "; ".join(errors + ([skipped] if skipped else [])))
        if known is not None:  # drop inner links the new route no longer uses
            for key, (eng, iid) in known.state.links.items():
                if route.links.get(key, (None, None))[1] != iid or route.links[key][0] is not eng:
                    try:
                        eng.disconnect(iid)
                    except Exception:  # noqa: BLE001 - best effort
                        pass
        if self._told.get(agent) != route.engine:
            self._told[agent] = route.engine
            extra = f"; its host regions via {route.fallback}" if route.host_regions and route.fallback else ""
            log.info("auto transport %s: peer %s -> %s (%s%s)", self.agent_name, agent, route.engine, route.reason, extra)
        return _Peer(agent, agent, regions, doc["engine_md"], route)

    def _engine_disconnect(self, peer: _Peer) -> None:
        first: Exception | None = None
        for eng, iid in peer.state.links.values():
            try:
                eng.disconnect(iid)
            except Exception as e:  # noqa: BLE001 - disconnect every link, then report
                first = first or e
        if first is not None:
            raise first

    # --------------------------------------------------------------------------------- transfers
    def _route_for(self, peer: _Peer, segs: Sequence[Segment]) -> tuple[Transport, _Peer, str]:
        r: _Route = peer.state
        key = r.primary
        remote = {x.name for x in used_regions(segs, "remote")} if r.host_regions else set()
        if r.host_regions and not remote.isdisjoint(r.host_regions):
            if "net" not in r.links:
                names = sorted(remote & set(r.host_regions))
                raise ValueError(f"auto: peer {peer.id!r} is reached by cuda-ipc, which cannot reach its host region(s) "
                                 f"{names}, and no network engine connects it")  # fmt: skip
            key = "net"
        eng, iid = r.links[key]
        if key == "net" and self._net_missing:
            local = {x.name for x in used_regions(segs, "local")}
            bad = sorted(local & set(self._net_missing))
            if bad:
                raise ValueError(f"auto: local region(s) {bad} are not registered with {eng.name} (it refused them)")
        ip = eng._peers.get(iid)
        if ip is None:
            raise TransportError(f"auto: peer {peer.id!r} is no longer connected to {eng.name}; connect() it again")
        return eng, ip, (r.engine if key == r.primary else eng.name)

    def _engine_validate(self, peer: _Peer, segs: Sequence[Segment]) -> None:
        eng, ip, _ = self._route_for(peer, segs)
        eng._engine_validate(ip, _for_engine(eng, segs))

    def _engine_submit(self, h: TransferHandle, peer: _Peer, segs: Sequence[Segment]) -> int:
        eng, ip, name = self._route_for(peer, segs)
        inner = TransferHandle(h.id, h.op, ip.id, h.descriptors, h.nbytes, h.local_regions, h.submitted_at)
        h.engine_state = _Routed(eng, name, inner)
        self._by_engine[name] = self._by_engine.get(name, 0) + 1
        return eng._engine_submit(inner, ip, _for_engine(eng, segs))

    def _engine_poll(self, h: TransferHandle) -> tuple[Status, str | None]:
        r: _Routed | None = h.engine_state
        if r is None:
            return "ERROR", "batch was never handed to an engine"
        return r.engine._engine_poll(r.handle)

    def stream_ordered(self, peer: str) -> bool:
        p = self._peers.get(peer)
        if p is None or p.state is None:
            return False
        r: _Route = p.state
        if r.host_regions:
            return False  # some batches to this peer may take the network engine
        eng, iid = r.links[r.primary]
        return eng.stream_ordered(iid)

    def peer_tensors(self, peer: str, names: Sequence[str]) -> list[torch.Tensor] | None:
        p = self._peers.get(peer)
        if p is None or p.state is None:
            return None
        eng, iid = p.state.links[p.state.primary]
        return eng.peer_tensors(iid, names)

    def _engine_block(self, h: TransferHandle, timeout_s: float) -> None:
        r: _Routed | None = h.engine_state
        if r is not None:
            r.engine._engine_block(r.handle, timeout_s)

    def _engine_release(self, h: TransferHandle) -> None:
        r: _Routed | None = h.engine_state
        if r is not None:
            r.engine._engine_release(r.handle)

    def _describe(self, h: TransferHandle, what: str) -> str:
        r = h.engine_state
        via = f"[{r.name}]" if isinstance(r, _Routed) else ""
        return (
            f"{self.name}{via}: {h.op} batch #{h.id} ({h.descriptors} descriptor(s), {h.nbytes} B) "
            f"with peer {h.peer!r} {what}"
        )

    # ------------------------------------------------------------------------------------ close
    def _engine_quiesce(self) -> None:
        for e in self._inner():
            try:
                e._engine_quiesce()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass

    def _engine_close(self) -> None:
        self._close_inner()

    def _close_inner(self) -> None:
        for e in self._inner():
            try:
                e.close()
            except Exception as ex:  # noqa: BLE001 - close every engine
                log.warning("auto transport %s: closing %s failed: %s", self.agent_name, e.name, ex)
        self._near = self._net = None
