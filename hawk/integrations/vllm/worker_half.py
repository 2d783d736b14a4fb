"""HawkConnector's worker half: Algorithm 1 over the KV cache vLLM registered (the lifecycle is stated in
scheduler_half.py).

Ownership: vLLM allocates and frees every block. A prefill's blocks named in a SendJob belong to HAWK's
sender from ``start`` until the sender gives them back (pulled, expired, discarded or closed), which the
worker reports through ``finished`` so vLLM frees them then, exactly once. A decode's blocks named in a
RecvJob are vLLM's throughout; HAWK writes into them until it reports the request as received.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from hawk.connector.algorithm1 import KVReceiver, KVSender
from hawk.connector.configs import GpuSide, get_config, make_receiver, make_sender
from hawk.connector.control import ControlServer
from hawk.connector.messages import Error, Holdings, Inspect, Message
from hawk.errors import DuplicateRequest
from hawk.integrations.vllm.plan import RecvJob, StepPlan
from hawk.integrations.vllm.settings import ConnectorSettings
from hawk.transport.registry import make_transport

log = logging.getLogger(__name__)
MiB = 1 << 20


class WorkerHalf:
    def __init__(self, settings: ConnectorSettings, producer: bool, consumer: bool):
        self.settings, self.producer, self.consumer = settings, producer, consumer
        self.transport: Any = None
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        self._server: ControlServer | None = None  # a consumer's ledger socket (a producer's sender has one)
        self._lock = threading.Lock()
        self._held: set[str] = set()  # sends whose blocks the sender holds
        self._sent: set[str] = set()  # ... given back, not yet reported to vLLM
        self._loading: set[str] = set()  # pulls in flight
        self._loaded: set[str] = set()  # ... done (or failed), not yet reported
        self._load_errors: set[int] = set()
        self._counts = {"pulled": 0, "pull_failures": 0, "handed_to_sender": 0, "keep_alives": 0}
        self._last_pull_s: float | None = None  # the last successful pull's time (connect + D1..D9)
        self._pulls = ThreadPoolExecutor(max_workers=4, thread_name_prefix="hawk-vllm-pull")
        # keep-alives off the forward path and behind no pull (a first one waits for its prefill's handshake)
        self._keep_alives = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hawk-vllm-keepalive")

    def register(self, caches: Sequence[torch.Tensor], layout: Any) -> None:
        """vLLM's per-layer caches (in layer order) and their described layout: build the sides."""
        s = self.settings
        self.transport = transport = make_transport(s.transport)
        if self.producer:
            self.sender = make_sender(s.transfer, transport, caches, layout, s.staging_mb * MiB, s.transform_impl,
                                      host=s.host, port=s.port, ttl_s=s.ttl_s, ledger=self.ledger,
                                      handoff_wait_s=s.handoff_wait_s)
        if self.consumer:
            if get_config(s.transfer).decode_on != "gpu":
                raise ValueError(f"HawkConnector: a vLLM decode lands KV in its own cache; {s.transfer} decodes on an NPU")
            self.receiver = make_receiver(s.transfer, transport, GpuSide(caches, layout, s.rx_mb * MiB), timeout_s=s.pull_timeout_s)
            if self.sender is None:
                self._server = ControlServer(self._inspect_only, s.host, s.port)

    @property
    def address(self) -> str:
        """Where this worker answers: Algorithm 1 (a producer) and Inspect (both)."""
        if self.sender is not None:
            return self.sender.address
        assert self._server is not None, "register() first"
        return self._server.address

    def start(self, plan: StepPlan) -> None:
        """Hand this step's finished prefills to the sender; start this step's pulls."""
        for job in plan.sends:
            assert self.sender is not None, "a SendJob on a worker without a sender"
            with self._lock:
                self._held.add(job.request_id)
                self._counts["handed_to_sender"] += 1
            try:
                self.sender.add(job.request_id, job.num_tokens, job.block_ids, functools.partial(self._given_back, job.request_id))
            except DuplicateRequest:
                log.error("request %s: KV already waiting under this id; giving its new blocks back", job.request_id)
                self._given_back(job.request_id)
        for job in plan.recvs:
            with self._lock:
                self._loading.add(job.request_id)
            self._pulls.submit(self._pull, job)
        for address, ids in plan.keep_alive.items():
            self._keep_alives.submit(self._keep_alive, address, ids)

    def _keep_alive(self, address: str, request_ids: list[str]) -> None:
        """Ask a prefill to keep these queued requests' KV another TTL (a failure leaves the TTL to decide)."""
        try:
            assert self.receiver is not None
            if self.receiver.keep_alive(address, request_ids):
                with self._lock:
                    self._counts["keep_alives"] += 1
        except Exception as e:  # noqa: BLE001 - the pull itself reports what is wrong with that prefill
            log.warning("keeping %d queued requests' KV alive at %s failed: %s", len(request_ids), address, e)

    def _given_back(self, request_id: str) -> None:
        with self._lock:
            self._held.discard(request_id)
            self._sent.add(request_id)

    def _pull(self, job: RecvJob) -> None:
        ok, t0 = False, time.perf_counter()
        try:
            assert self.receiver is not None
            h = job.handle
            self.receiver.connect(h.address)
            self.receiver.pull(h.address, h.request_id, job.block_ids, num_tokens=h.num_tokens)
            ok = True
            self._last_pull_s = time.perf_counter() - t0
        except Exception:  # noqa: BLE001 - a failed pull fails its blocks, never the worker
            log.exception("request %s: pulling its KV failed; reported as a load error (vLLM recomputes or fails it)", job.request_id)
        with self._lock:
            self._counts["pulled" if ok else "pull_failures"] += 1
            if not ok:
                self._load_errors.update(job.block_ids)
            self._loading.discard(job.request_id)
            self._loaded.add(job.request_id)

    def finished(self) -> tuple[set[str], set[str]]:
        """Requests whose blocks vLLM may free (sent) or schedule (received), each reported once."""
        with self._lock:
            sent, self._sent = self._sent, set()
            loaded, self._loaded = self._loaded, set()
        return sent, loaded

    def load_errors(self) -> set[int]:
        with self._lock:
            errs, self._load_errors = self._load_errors, set()
        return errs

    def ledger(self) -> dict[str, Any]:
        """Everything HAWK holds in this worker (what Inspect answers): the sender's and receiver's
        reservations and the requests between HAWK and vLLM."""
        with self._lock:
            out: dict[str, Any] = {"held": sorted(self._held), "unreported_sent": sorted(self._sent),
                                   "loading": sorted(self._loading), "unreported_loaded": sorted(self._loaded), **self._counts,
                                   "last_pull_s": self._last_pull_s}
        if self.sender is not None:
            out["sender"] = self.sender.ledger()
        if self.receiver is not None:
            a = self.receiver.accounting()
            out["receiver"] = {**a, "reservations": len(a["reservations"])}
        return out

    def _inspect_only(self, msg: Message, ident: bytes) -> Message:
        if isinstance(msg, Inspect):
            return Holdings(self.ledger())
        return Error(getattr(msg, "request_id", ""), f"this vLLM decode worker answers only inspect, not {msg.TYPE!r}")

    def close(self) -> None:
        """Give everything back: the sender returns held blocks (reported by ``finished``), pulls end."""
        self._keep_alives.shutdown(wait=True, cancel_futures=True)
        self._pulls.shutdown(wait=True, cancel_futures=True)
        if self.sender is not None:
            self.sender.close()
        if self.receiver is not None:
            self.receiver.close()
        if self._server is not None:
            self._server.close()
        if self.transport is not None:
            self.transport.close()
