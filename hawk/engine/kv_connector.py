"""The named interface between the engines and the KV connector: who owns which blocks, and when.

vLLM splits its ``KVConnectorBase_V1`` into a scheduler side and a worker side; HAWK's engines
need less, because Algorithm 1 (``hawk/connector/algorithm1.py``) runs the whole transfer. What
they need is said here, once, as the protocols the engines take:

* :class:`PrefillKVConnector` — the prefill engine's ``handoff``: ``HawkSender.add`` or the
  colocated instance's ``_handoff``.
* :class:`LayerPushConnector` — the prefill engine's ``layer_push`` (``KVSender.begin_push``).
* :class:`DecodeKVConnector` — the decode engine's ``kv``: ``RemoteKV`` (pull over HAWK) or
  ``LocalKV`` (colocated, take the blocks over), both in ``decode_engine.py``.

Ownership, in one line each:
  prefill: the engine allocates; ``hand_off`` transfers ownership; the connector frees, exactly once.
  decode:  the engine allocates; ``admit`` fills; the engine frees through ``release``, exactly once;
           a request that leaves before ``admit`` gives its handle back through ``drop``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from hawk.engine.block_manager import BlockManager
from hawk.engine.sequence import Sequence as Seq

#: Frees a prefilled request's paged blocks; the connector calls it exactly once.
FreeBlocks = Callable[[], None]


class PrefillKVConnector(Protocol):
    """Where the prefill engine hands a finished prompt's KV (its paged blocks) to be sent.

    Called as ``connector(request_id, num_tokens, block_ids, free)`` from the engine thread,
    right after the forward pass that wrote the blocks.
    """

    def __call__(self, request_id: str, num_tokens: int, block_ids: list[int], free: FreeBlocks) -> None:
        """Take ownership of ``block_ids`` (holding ``num_tokens`` tokens of KV) for ``request_id``.

        From this call on the engine never touches those blocks again; the connector calls
        ``free`` exactly once, when the decode side has pulled them (or had them pushed), when
        they are discarded (the client left: ``discard(request_id)``), when they wait past
        their TTL, or when the connector closes. Raising instead of returning means the
        connector did not take them and the engine frees them itself: an id that already has
        KV waiting should raise ``hawk.errors.DuplicateRequest``.
        """
        ...


class LayerFeed(Protocol):
    """One request's layer-wise push during its last forward (kv_flow=layerwise)."""

    def layer_written(self, layer: int, marker: Any = None) -> None:
        """Layer ``layer``'s KV is in the paged cache (enqueued on the caller's current stream, on
        CUDA; or, when ``marker`` is a CUDA event, once it completes): send it beside the forward."""
        ...

    def failed(self, error: BaseException | str) -> None:
        """The forward or the first token failed: the push stops; the engine frees its blocks."""
        ...


class LayerPushConnector(Protocol):
    """Where the prefill engine announces a request's last forward (``KVSender.begin_push``).

    Called as ``begin_push(request_id, num_tokens, block_ids)`` on the engine thread right before
    the forward that completes the prompt; returns a :class:`LayerFeed` when the decode has handed
    over a destination (the engine then reports each layer, and still hands the blocks off after
    the forward, as always), or None (nothing to push: the KV goes the pull way).
    """

    def __call__(self, request_id: str, num_tokens: int, block_ids: list[int]) -> LayerFeed | None: ...


class DecodeKVConnector(Protocol):
    """How the decode engine gets a sequence's prompt KV into blocks it has allocated."""

    #: The decode cache's allocator: the engine allocates from it before ``admit``.
    blocks: BlockManager
    #: The prompt's KV is already in this engine's blocks when a request arrives (``LocalKV`` on a
    #: CPU): its first token goes out at submit and admission runs on the engine thread.
    kv_here: bool

    def blocks_needed(self, seq: Seq) -> int:
        """Blocks the engine must allocate for ``seq`` at admission (the prompt's KV and the first
        decode step's token, or only the latter when the prompt's blocks are taken over, as
        colocated does)."""
        ...

    def admit(self, seq: Seq, block_ids: list[int], handle: Any) -> dict[str, Any]:
        """Fill ``block_ids`` with the prompt KV named by ``handle`` (blocking, on the engine's
        admission path); returns what the client sees about the transfer (time, bytes, requests,
        mode). Blocks stay the engine's throughout: on an exception the engine still owns them
        and must ``release``; the connector has already released its own transfer reservations
        (receive buffers, the prefill's staging) on every path, as Algorithm 1 requires."""
        ...

    def keep_alive(self, handles: list[Any]) -> None:
        """Tell the KV's holders that these requests are still queued here, so a memory-bound
        decode delays them instead of letting the prefill's TTL expire them."""
        ...

    def drop(self, handle: Any) -> None:
        """A request leaves before ``admit`` (aborted, or the engine closed while it queued): give
        back whatever its handle holds (the prefill's staged KV, a colocated prompt's blocks)."""
        ...

    def release(self, seq: Seq) -> None:
        """Return ``seq``'s blocks to ``blocks`` (finished, aborted or failed); idempotent, so
        the engine may call it on every exit path."""
        ...
