"""Next-token choice for a whole batch on the logits' device, with one host sync.

Greedy rows take the argmax; temperature / top-p rows take the Gumbel-max of their scaled,
truncated logits with noise from the request's own seeded generator, which is the same
distribution as softmax-then-multinomial without a per-row host round trip.

Sampling is total, so one bad request cannot take an engine thread down:

* seeds: any integer; it is taken modulo 2**64 (torch's seed range; -1 means 2**64 - 1, as
  ``torch.manual_seed`` already reads it). ``SamplingParams`` refuses non-integers.
* temperatures below :data:`GREEDY_BELOW` are greedy (dividing by them overflows), and the
  logits are shifted by their maximum before scaling, so no temperature overflows to inf/NaN.
* non-finite logits (NaN, ±inf) never win: the choice is over the finite ones. A row with no
  finite logit gets :data:`NO_TOKEN`; :func:`sample` raises :class:`NonFiniteLogits` for it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from hawk.engine.sequence import SamplingParams

#: Temperatures below this sample greedily (vLLM uses the same cut-off).
GREEDY_BELOW = 1e-5
#: Temperatures above this are clamped: fp32 would make them inf, and the distribution is flat anyway.
_MAX_TEMPERATURE = 1e30
#: The token of a row whose logits hold no finite value.
NO_TOKEN = -1
_SEED_SPACE = 1 << 64


class NonFiniteLogits(ValueError):
    """Every logit of a row is NaN or infinite: there is nothing to choose from."""


def seed_for(seed: int, stream: int = 0) -> int:
    """``seed`` mapped into ``[0, 2**64)``; ``stream > 0`` derives an independent seed from it.

    Streams keep one request's engines apart: the prefill samples the first token from stream 0
    and the decode engine continues from stream 1, so they never reuse the same noise.
    """
    base = int(seed) % _SEED_SPACE
    if stream == 0:
        return base
    digest = hashlib.blake2b(f"{base}:{stream}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class RequestRng:
    """A request's random stream: one seeded ``torch.Generator`` per device, made on first use.

    The same seed gives the same tokens on the same kind of device (CPU and CUDA generators
    produce different streams).
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._gens: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        g = self._gens.get(device)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(self.seed)
            self._gens[device] = g
        return g


Generator = RequestRng | torch.Generator


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < GREEDY_BELOW


def make_generator(params: SamplingParams, stream: int = 0) -> RequestRng | None:
    """The request's stream (None when greedy: it draws nothing). Unseeded: a fresh random seed."""
    if is_greedy(params):
        return None
    seed = params.seed if params.seed is not None else torch.seed()
    return RequestRng(seed_for(seed, stream))


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Argmax over the finite values of each row of ``logits [B, V]``; :data:`NO_TOKEN` if none.

    Pure device ops and fixed shapes, so a CUDA graph can capture it. On a CPU, where reading a value
    back costs nothing, one pass first: a row whose max is finite holds no NaN nor +inf, so its first
    maximal index is the answer (the full form reads the logits five times).
    """
    if logits.device.type == "cpu" and logits.numel():
        best, idx = logits.max(-1)
        if bool(torch.isfinite(best).all()):
            return idx
    finite = torch.isfinite(logits)
    best = logits.masked_fill(~finite, float("-inf")).argmax(-1)
    return torch.where(finite.any(-1), best, torch.full_like(best, NO_TOKEN))


def sample_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[Generator | None],
    greedy: torch.Tensor | None = None,
) -> torch.Tensor:
    """The tokens ``[B]`` (int64, on the logits' device) for ``logits [B, V]``; no host sync.

    ``greedy`` may pass :func:`greedy_tokens` of these logits when already computed (a CUDA
    graph does). Only the rows that sample draw from their generators.
    """
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(generators) != len(params):
        raise ValueError(
            f"logits {tuple(logits.shape)} do not match {len(params)} params / {len(generators)} generators"
        )
    if greedy is None:
        greedy = greedy_tokens(logits)
    rows = [i for i, p in enumerate(params) if not is_greedy(p)]
    if not rows:
        return greedy
    dev = logits.device
    idx = _to_device(torch.tensor(rows, dtype=torch.int64), dev)
    chosen = _sample_rows(
        logits.index_select(0, idx).float(),
        [params[i] for i in rows],
        [generators[i] for i in rows],
    )
    chosen = torch.where(greedy.index_select(0, idx) == NO_TOKEN, NO_TOKEN, chosen)
    return greedy.clone().index_copy_(0, idx, chosen)


def sample_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[Generator | None],
    greedy: torch.Tensor | None = None,
) -> list[int]:
    """:func:`sample_tokens`, fetched: the step's one host sync. :data:`NO_TOKEN` marks rows
    whose logits had no finite value (the engines fail those requests)."""
    return sample_tokens(logits, params, generators, greedy).tolist()


def sample(logits: torch.Tensor, params: SamplingParams, generator: Generator | None = None) -> int:
    """One token from ``logits [vocab]`` (single-row form of :func:`sample_batch`)."""
    tok = sample_batch(logits.reshape(1, -1), [params], [generator])[0]
    if tok == NO_TOKEN:
        raise NonFiniteLogits("no finite logit to sample from")
    return tok


def _sample_rows(
    x: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[Generator | None]
) -> torch.Tensor:
    """Gumbel-max over ``x [R, V]`` (fp32) at each row's temperature and top-p."""
    dev = x.device
    temps = [min(p.temperature, _MAX_TEMPERATURE) for p in params]
    t = _to_device(torch.tensor(temps, dtype=torch.float32), dev)
    x = x.masked_fill(~torch.isfinite(x), float("-inf"))
    # Shift by the row maximum before scaling: every value is <= 0, so dividing by a small
    # temperature can only underflow to -inf (probability 0), never overflow.
    z = (x - x.amax(-1, keepdim=True)) / t[:, None]
    z = z.masked_fill(torch.isnan(z), float("-inf"))  # rows with no finite value: NO_TOKEN later
    top_p = [p.top_p for p in params]
    if any(p < 1.0 for p in top_p):
        z = _top_p_mask(z, _to_device(torch.tensor(top_p, dtype=torch.float32), dev))
    u = torch.empty_like(z)
    for r, g in enumerate(generators):
        _uniform(u[r], g)
    tiny = torch.finfo(u.dtype).tiny
    gumbel = -torch.log(-torch.log(u.clamp_(min=tiny)))
    return (z + gumbel).argmax(-1)


def _top_p_mask(z: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's smallest set of most likely tokens whose mass reaches ``top_p``.

    A token is kept when the mass before it (in descending order) is below ``top_p``, so the
    most likely token always stays; rows with ``top_p >= 1`` keep everything.
    """
    probs = torch.softmax(z, dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    keep_sorted = (sorted_p.cumsum(-1) - sorted_p) < top_p[:, None]
    keep_sorted |= (top_p >= 1.0)[:, None]
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    return z.masked_fill(~keep, float("-inf"))


def _uniform(out: torch.Tensor, g: Generator | None) -> None:
    """Fill ``out`` with U[0, 1) from the request's generator (the global one when None)."""
    if g is None:
        out.uniform_()
        return
    gen = g.generator(out.device) if isinstance(g, RequestRng) else g
    if gen.device == out.device:
        out.uniform_(generator=gen)
    else:  # a caller's generator on another device (e.g. a CPU torch.Generator): draw there
        out.copy_(torch.empty(out.shape, device=gen.device).uniform_(generator=gen))


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without a host sync (pageable H2D is staged at once)."""
    return t if device.type == "cpu" else t.to(device, non_blocking=True)
