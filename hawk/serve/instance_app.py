"""The FastAPI app around one engine instance (prefill, decode or colocated).

The role-specific routes come from prefill_server / decode_server; this adds what every instance
answers: /health, /internal/info (limits the router validates against), /internal/accounting
(what it holds: staging and receive reservations, KV blocks), /internal/tokenizer and /metrics.
Shutting the app down closes the instance, which releases its registered buffers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import Response

from hawk.engine.tokenizer import Tokenizer
from hawk.serve.common import install_error_handlers
from hawk.serve.metrics import CONTENT_TYPE, instance_registry
from hawk.serve.tokenizer_wire import tokenizer_to_wire

log = logging.getLogger(__name__)


def build_instance_app(
    role: str,
    routers: list[APIRouter],
    info: dict[str, Any],
    accounting: Callable[[], dict[str, Any]],
    tokenizer: Tokenizer | None,
    close: Callable[[], None] | None,
) -> FastAPI:
    """An app serving ``routers`` plus the common instance endpoints; ``close`` runs at shutdown."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if close is not None:
            log.info("%s instance shutting down: closing engine and releasing buffers", role)
            await asyncio.to_thread(close)

    app = FastAPI(title=f"HAWK {role} instance", lifespan=lifespan, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    for r in routers:
        app.include_router(r)
    registry = instance_registry(role, accounting)
    wire: dict[str, Any] | None = None

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok", "role": role}

    @app.get("/internal/info")
    async def get_info() -> dict[str, Any]:
        return info

    @app.get("/internal/accounting")
    def get_accounting() -> dict[str, Any]:  # sync: runs in the threadpool, off the event loop
        return accounting()

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
