"""NIXL (UCX backend) behind the HAWK transport interface.

One NIXL agent per Transport, with its progress thread on (without it, UCX only progresses while we
poll, and a stalled poller stalls the peer too). Regions are registered as DRAM or VRAM (device id
from the tensor). The peer's agent metadata rides inside our metadata blob; connect() loads it with
add_remote_agent, and loading it again (after the peer registered more memory) refreshes it.

A batch is one NIXL transfer request: local and remote descriptor lists built with get_xfer_descs,
then initialize_xfer + transfer; completion by check_xfer_state. NIXL needs one memory type per list,
so a batch mixing DRAM and VRAM on one side is split into one request per (local, remote) type pair.

Environment: UCX picks its transports from UCX_TLS / UCX_NET_DEVICES. Tests and single-host runs set
``UCX_NET_DEVICES=lo`` (loopback; shared memory is still used between processes of one host).

Exit crash workaround: the nixl-cu13 wheel vendors rdma-core and libnl; UCX's ib modules load them, and
the vendored libibverbs then also loads the system's verbs providers (Debian's ibverbs-providers, which
Mooncake needs) with the system libnl. Two libnl-route copies crash in their destructors when the
process exits (SIGSEGV in rtnl_tc_unregister, exit code 139, even after every agent is gone). On hosts
without RDMA devices the ib modules are useless, so unless UCX_MODULES is set we skip them there
(``UCX_MODULES=^ib*``, process-wide, before the first agent starts UCX). Where /sys/class/infiniband
lists devices nothing is changed.

CPU cost: NIXL's progress thread spins (sched_yield), so every live agent keeps one core busy.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
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
)

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install --no-deps nixl==1.5.1 nixl-cu13==1.5.1 numpy"


def _load_nixl() -> tuple[Any, Any]:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs every agent creation to stdout at INFO
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as e:  # the meta-package raises ImportError for a missing CUDA build too
        raise TransportUnavailable(f"nixl transport needs the NIXL Python package ({INSTALL_HINT}): {e}") from e
    return nixl_agent, nixl_agent_config


def _skip_ib_modules_without_rdma_devices() -> None:
    """Avoid the exit-time libnl crash (module docstring) where no RDMA device could use ib anyway."""
    if "UCX_MODULES" in os.environ:
        return
    ib = "/sys/class/infiniband"
    if os.path.isdir(ib) and os.listdir(ib):
        return
    os.environ["UCX_MODULES"] = "^ib*"


def _progress_delay_default() -> int:
    """Microseconds the progress thread sleeps between sweeps: spin on big hosts, nap on small ones.

    NIXL's Python wrapper starts the progress thread with no delay, so every agent keeps one core
    busy even when idle; on a 2-core box that starves the model running beside it. 200 us costs at
    most that much latency per transfer and frees the core (measured: an idle agent went from 2.0
    to 0.04 CPU-seconds per 2 s with a 1 ms delay).
    """
    env = os.environ.get("HAWK_NIXL_PROGRESS_DELAY_US")
    if env is not None:
        return int(env)
    return 0 if (os.cpu_count() or 1) >= 8 else 200


def _delayed_config(base: type, delay_us: int) -> type:
    """The bindings' agent config, keeping ``delay_us`` when NIXL's wrapper assigns ``pthrDelay = 0``
    (hard-coded there): the least intrusive way to make its progress thread pause between sweeps."""

    class _Config(base):  # type: ignore[misc, valid-type]
        def __setattr__(self, key: str, value: Any) -> None:
            super().__setattr__(key, max(int(value), delay_us) if key == "pthrDelay" else value)

    return _Config


def _agent_with_progress_delay(nixl_agent: Any, name: str, conf: Any, delay_us: int) -> Any:
    """Create an agent whose progress thread sleeps ``delay_us`` between sweeps (this agent only)."""
    import nixl._api as api

    base = api.nixlBind.nixlAgentConfig
    api.nixlBind.nixlAgentConfig = _delayed_config(base, delay_us)
    try:
        return nixl_agent(name, conf)
    finally:
        api.nixlBind.nixlAgentConfig = base


def pause_progress_threads(delay_us: int | None = None) -> int:
    """Make every NIXL agent this process creates from now on pause ``delay_us`` between progress sweeps
    (default: ``_progress_delay_default``), agents HAWK does not create included (vLLM's NixlConnector in
    ``hawk bench vllm-pd``'s ``vllm-nixl-paused``). Returns the delay; 0 changes nothing."""
    delay = _progress_delay_default() if delay_us is None else delay_us
    if delay:
        import nixl._api as api

        api.nixlBind.nixlAgentConfig = _delayed_config(api.nixlBind.nixlAgentConfig, delay)
    return delay


def _mem_type(info: RegionInfo) -> str:
    return "VRAM" if info.device == "cuda" else "DRAM"


def _dev_id(info: RegionInfo) -> int:
    return info.device_id if info.device == "cuda" else 0  # NIXL uses device id 0 for DRAM


#: One NIXL transfer's descriptors: ``((local memory type, remote memory type), local [n, 3], remote [n, 3])``,
#: rows ``(address, length, device id)`` as uint64, what ``get_xfer_descs`` takes.
_Group = tuple[tuple[str, str], np.ndarray, np.ndarray]


def _segment_groups(segs: Sequence[Segment]) -> list[_Group]:
    groups: dict[tuple[str, str], list[Segment]] = {}
    for s in segs:
        groups.setdefault((_mem_type(s.local), _mem_type(s.remote)), []).append(s)
    return [(key,
             np.array([(s.local_addr, s.length, _dev_id(s.local)) for s in group], dtype=np.uint64),
             np.array([(s.remote_addr, s.length, _dev_id(s.remote)) for s in group], dtype=np.uint64))
            for key, group in groups.items()]


def _array_groups(segs: SegArray) -> list[_Group]:
    """:func:`_segment_groups` with numpy: no object per descriptor."""
    sides = []
    for infos, idx, off in ((segs.local, segs.local_idx, segs.local_offset), (segs.remote, segs.remote_idx, segs.remote_offset)):
        mem = np.array([_mem_type(r) == "VRAM" for r in infos])[idx]
        rows = np.stack([np.array([r.addr for r in infos], dtype=np.int64)[idx] + off, segs.length,
                         np.array([_dev_id(r) for r in infos], dtype=np.int64)[idx]], axis=1).astype(np.uint64)
        sides.append((mem, rows))
    (lmem, lrows), (rmem, rrows) = sides
    out = []
    for lv in (False, True):
        for rv in (False, True):
            m = (lmem == lv) & (rmem == rv)
            if m.any():
                out.append(((("VRAM" if lv else "DRAM"), ("VRAM" if rv else "DRAM")), lrows[m], rrows[m]))
    return out


class NixlTransport(Transport):
    """NIXL agent with the UCX backend (or other backends via ``backends``)."""

    name = "nixl"
    takes_arrays = True  # descriptor lists straight from the arrays
    drain_s = 5.0

    def __init__(
        self,
        agent_name: str | None = None,
        backends: tuple[str, ...] = ("UCX",),
        num_threads: int = 0,
        progress_delay_us: int | None = None,
    ) -> None:
        nixl_agent, nixl_agent_config = _load_nixl()
        super().__init__(agent_name)
        _skip_ib_modules_without_rdma_devices()
        conf = nixl_agent_config(enable_prog_thread=True, backends=list(backends), num_threads=num_threads)
        delay = _progress_delay_default() if progress_delay_us is None else progress_delay_us
        self._agent = _agent_with_progress_delay(nixl_agent, self.agent_name, conf, delay) if delay else nixl_agent(self.agent_name, conf)
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            raise TransportError(f"nixl: backend(s) {missing} not available (plugins: {self._agent.get_plugin_list()})")
        self._zombies: list[Any] = []  # xfer handles NIXL refused to release (still active)

    # ---------------------------------------------------------------------------------- regions
    def _engine_register(self, info: RegionInfo, tensor: torch.Tensor) -> Any:
        descs = [(info.addr, info.length, _dev_id(info), "")]
        return self._agent.register_memory(descs, _mem_type(info))

    def _engine_deregister(self, info: RegionInfo, token: Any) -> None:
        self._agent.deregister_memory(token)

    def _engine_metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    # ------------------------------------------------------------------------------------ peers
    def _engine_connect(self, doc: dict[str, Any], regions: dict[str, RegionInfo], known: _Peer | None) -> _Peer:
        try:
            name = self._agent.add_remote_agent(doc["engine_md"])  # reloading refreshes a known agent
        except Exception as e:  # noqa: BLE001 - NIXL raises its own exception types
            why = f"{type(e).__name__}: {e}"
            raise ConnectError(f"nixl: add_remote_agent failed for {doc.get('agent')!r}: {why}") from e
        pid = name.decode() if isinstance(name, bytes) else str(name)
        return _Peer(pid, doc["agent"], regions, doc["engine_md"])

    def _engine_disconnect(self, peer: _Peer) -> None:
        self._agent.remove_remote_agent(peer.id)

    # -------------------------------------------------------------------------------- transfers
    def _engine_submit(self, h: TransferHandle, peer: _Peer, segs: Sequence[Segment]) -> int:
        xfers: list[Any] = []
        h.engine_state = xfers
        groups = _array_groups(segs) if isinstance(segs, SegArray) else _segment_groups(segs)
        for (lmem, rmem), local, remote in groups:
            ld = self._agent.get_xfer_descs(local, lmem)
            rd = self._agent.get_xfer_descs(remote, rmem)
            x = self._agent.initialize_xfer(h.op, ld, rd, peer.id)
            xfers.append(x)
            if self._agent.transfer(x) == "ERR":
                raise TransportError("transfer() returned ERR when posting")
        return len(groups)

    def _engine_poll(self, h: TransferHandle) -> tuple[Status, str | None]:
        done = True
        for x in h.engine_state:
            s = self._agent.check_xfer_state(x)
            if s == "ERR":
                return "ERROR", "check_xfer_state reported ERR"
            done = done and s == "DONE"
        return ("DONE" if done else "PENDING"), None

    def _engine_release(self, h: TransferHandle) -> None:
        for x in h.engine_state or ():
            try:
                x.release()  # NIXL tries to abort a request still in progress
            except Exception as e:  # noqa: BLE001 - keep it alive and retry at close
                log.warning("nixl: could not release transfer of batch #%d yet (%s); retrying at close", h.id, e)
                self._zombies.append(x)
        h.engine_state = None

    def _engine_close(self) -> None:
        for x in self._zombies:
            try:
                x.release()
            except Exception:  # noqa: BLE001 - nixl_agent's destructor makes a last attempt
                pass
        self._zombies.clear()
        self._agent = None  # drops the agent: stops its progress thread, closes UCX
