"""The FastAPI app around one engine instance (prefill, decode or colocated).

The role-specific routes come from prefill_server / decode_server; this adds what every instance
answers: /health, /internal/info (limits the router validates against), /internal/accounting
(what it holds: staging and receive reservations, KV blocks), /internal/tokenizer and /metrics.
Shutting the app down closes the instance, which releases its registered buffers.

/health is truthful: 503 once an engine thread has died (nothing it was given will ever finish),
or a tensor-parallel rank's process has (its ``dead`` list names the rank and its pid).
With a cluster secret, every /internal/* route wants ``Authorization: Bearer <secret>`` (401
otherwise, before the body is read); /health and /metrics stay open for probes and scrapers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse, Response

from hawk.engine.tokenizer import Tokenizer
from hawk.serve.contract import Accounting, Health, InstanceInfo
from hawk.serve.common import RequireBearer, cluster_secret_from_env, engine_alive, install_error_handlers
from hawk.serve.metrics import CONTENT_TYPE, instance_registry
from hawk.serve.tokenizer_wire import tokenizer_to_wire

log = logging.getLogger(__name__)


def engine_stats(engine: Any) -> dict[str, Any]:
    """An engine's queue for /internal/accounting, each key prefixed ``engine_`` (``engine_waiting``, ...)."""
    return {f"engine_{k}": v for k, v in engine.stats().items()}


def dead_rank_names(instance: Any) -> list[str]:
    """The instance's dead tensor-parallel ranks as /health lists them ("tp rank 1 (pid 4242)")."""
    pids = getattr(instance, "rank_pids", {})
    return [f"tp rank {r} (pid {pids.get(r)})" for r in getattr(instance, "dead_ranks", [])]


def unavailable_reason(role: str, instance: Any) -> str | None:
    """Why new work must be refused (a 503, before it is queued), or None while every rank lives:
    a request needs every rank's heads, so one dead rank makes the whole instance unable to serve
    until the launcher restarts it."""
    dead = dead_rank_names(instance)
    if not dead:
        return None
    return f"{role} instance has a dead tensor-parallel rank ({', '.join(dead)}); it is being restarted, retry shortly"


def build_instance_app(
    role: str,
    routers: list[APIRouter],
    info: InstanceInfo,
    accounting: Callable[[], dict[str, Any]],
    tokenizer: Tokenizer | None,
    close: Callable[[], None] | None,
    engines: Sequence[Any] = (),
    cluster_secret: str | None = None,
    dead_ranks: Callable[[], list[str]] | None = None,
) -> FastAPI:
    """An app serving ``routers`` plus the common instance endpoints; ``close`` runs at shutdown.

    ``engines`` are watched by /health, and so are the tensor-parallel ranks that
    ``dead_ranks`` names (a dead rank leaves rank 0's engine thread running but unable to
    serve); ``cluster_secret`` (default: $HAWK_CLUSTER_SECRET) guards /internal/*.
    """

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if close is not None:
            log.info("%s instance shutting down: closing engine and releasing buffers", role)
            await asyncio.to_thread(close)

    app = FastAPI(title=f"HAWK {role} instance", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    secret = cluster_secret or cluster_secret_from_env()
    app.add_middleware(RequireBearer, token=secret, protected=lambda p: p.startswith("/internal/"), what="cluster secret")
    for r in routers:
        app.include_router(r)
    registry = instance_registry(role, accounting)
    wire: dict[str, Any] | None = None

    @app.get("/health")
    async def health() -> JSONResponse:
        dead = [type(e).__name__ for e in engines if not engine_alive(e)] + (dead_ranks() if dead_ranks is not None else [])
        body = Health.of(status="engine_dead" if dead else "ok", role=role, dead=dead)
        return JSONResponse(body.model_dump(), status_code=503 if dead else 200)

    @app.get("/internal/info")
    async def get_info() -> InstanceInfo:
        return info

    @app.get("/internal/accounting")
    def get_accounting() -> Accounting:  # sync: runs in the threadpool, off the event loop
        return Accounting.of(role=role, **accounting())

    @app.get("/internal/tokenizer")
    def get_tokenizer() -> dict[str, Any]:
        nonlocal wire
        if tokenizer is None:
            return {}
        if wire is None:
            wire = tokenizer_to_wire(tokenizer)
        return wire

    @app.get("/metrics")
    def metrics() -> Response:
        from prometheus_client import generate_latest

        return Response(generate_latest(registry), media_type=CONTENT_TYPE)

    return app
