"""Device sampling: greedy and seeded temperature / top-p rows in one batch, and its totality
(huge seeds, vanishing temperatures, NaN / inf logits never raise out of a batch)."""

from __future__ import annotations

import math

import pytest
import torch

from hawk.engine.sampler import (
    GREEDY_BELOW,
    NO_TOKEN,
    NonFiniteLogits,
    RequestRng,
    greedy_tokens,
    make_generator,
    sample,
    sample_batch,
    seed_for,
)
from hawk.engine.sequence import SamplingParams

NAN, INF = float("nan"), float("inf")


def _logits(rows: int = 4, vocab: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_rows_take_the_argmax() -> None:
    x = _logits()
    params = [SamplingParams()] * 4
    assert sample_batch(x, params, [None] * 4) == x.argmax(-1).tolist()
    assert sample(x[2], SamplingParams()) == int(x[2].argmax())


def test_greedy_on_rows_all_finite_takes_the_first_maximal_index() -> None:
    """The CPU's one-pass form (every row's max finite), ties included, against argmax."""
    x = _logits(5)
    x[0, 10] = x[0, 20] = 50.0
    x[3, :] = 1.0
    got = greedy_tokens(x)
    assert got.tolist() == x.argmax(-1).tolist() and got[0] == 10 and got[3] == 0


def test_non_finite_logits_never_win() -> None:
    x = _logits(3)
    x[0, 5], x[0, 7] = NAN, INF
    x[1, :] = NAN
    x[2, 9], x[2, 10] = -INF, INF
    finite = x.masked_fill(~torch.isfinite(x), -INF)
    want = [int(finite[0].argmax()), NO_TOKEN, int(finite[2].argmax())]
    assert greedy_tokens(x).tolist() == want
    params = [SamplingParams(temperature=0.9, seed=1), SamplingParams(temperature=0.9, seed=2), SamplingParams(temperature=0.5, top_p=0.5, seed=3)]
    got = sample_batch(x, params, [make_generator(p) for p in params])
    assert got[1] == NO_TOKEN and got[0] not in (5, 7) and got[2] not in (9, 10)
    with pytest.raises(NonFiniteLogits):
        sample(x[1], SamplingParams())


def test_vanishing_and_huge_temperatures() -> None:
    x = _logits(2)
    for t in (1e-45, 5e-324, GREEDY_BELOW / 2):
        p = SamplingParams(temperature=t, seed=3)
        assert make_generator(p) is None  # greedy: draws nothing
        assert sample(x[0], p, make_generator(p)) == int(x[0].argmax())
    # just above the cut-off the scaled logits underflow, never overflow: still the argmax
    p = SamplingParams(temperature=GREEDY_BELOW * 2, seed=3)
    assert sample(x[0], p, make_generator(p)) == int(x[0].argmax())
    huge = SamplingParams(temperature=1e300, seed=3)
    assert 0 <= sample(x[1], huge, make_generator(huge)) < x.shape[1]


def test_any_integer_seed_works_and_is_taken_modulo_2_64() -> None:
    x = _logits(1, 1000)[0]
    for seed in (2**64, 2**70, -(2**63) - 1, -(2**70), 2**64 - 1, 0):
        p = SamplingParams(temperature=1.0, seed=seed)
        assert 0 <= sample(x, p, make_generator(p)) < 1000
    assert seed_for(2**64 + 5) == 5 and seed_for(-1) == 2**64 - 1
    assert seed_for(5, stream=1) != seed_for(5) and seed_for(5, stream=1) == seed_for(5, stream=1)


def test_bad_params_are_value_errors() -> None:
    for bad in ({"temperature": NAN}, {"temperature": INF}, {"temperature": -1.0},
                {"top_p": NAN}, {"top_p": 0.0}, {"seed": 1.5}, {"seed": "7"}, {"seed": True}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_same_seed_same_tokens_and_rows_are_independent() -> None:
    x = _logits(3, 500)
    params = [SamplingParams(temperature=1.0, seed=11), SamplingParams(), SamplingParams(temperature=0.7, top_p=0.8, seed=12)]

    def run(rows: list[int]) -> list[list[int]]:
        gens = [make_generator(params[r]) for r in rows]
        return [sample_batch(x[rows], [params[r] for r in rows], gens) for _ in range(20)]

    a, b = run([0, 1, 2]), run([0, 1, 2])
    assert a == b
    # row 0 alone draws what it drew beside the others: its noise is its own
    alone = run([0])
    assert [s[0] for s in a] == [s[0] for s in alone]
    assert len({s[0] for s in a}) > 1  # and it does sample
    other = [sample_batch(x[:1], params[:1], [RequestRng(seed_for(99))]) for _ in range(20)]
    assert other != [[s[0]] for s in a]


def test_torch_generators_still_accepted() -> None:
    x = _logits(1, 100)[0]
    p = SamplingParams(temperature=1.0)
    one = [sample(x, p, torch.Generator().manual_seed(4)) for _ in range(3)]
    assert len(set(one)) == 1


def test_temperature_sampling_follows_the_softmax() -> None:
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    n = 4000
    x = probs.log().expand(n, 4).contiguous()
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(n)]
    toks = torch.tensor(sample_batch(x, params, [make_generator(p) for p in params]))
    freq = torch.bincount(toks, minlength=4).float() / n
    assert torch.allclose(freq, probs, atol=4 * math.sqrt(0.25 / n))
    # temperature 2 flattens: p ** (1/2), renormalised
    params = [SamplingParams(temperature=2.0, seed=i) for i in range(n)]
    toks = torch.tensor(sample_batch(x, params, [make_generator(p) for p in params]))
    want = probs.sqrt() / probs.sqrt().sum()
    assert torch.allclose(torch.bincount(toks, minlength=4).float() / n, want, atol=4 * math.sqrt(0.25 / n))


def test_top_p_keeps_the_nucleus() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 4000
    x = probs.log().expand(n, 4).contiguous()
    params = [SamplingParams(temperature=1.0, top_p=0.7, seed=i) for i in range(n)]
    toks = torch.tensor(sample_batch(x, params, [make_generator(p) for p in params]))
    freq = torch.bincount(toks, minlength=4).float() / n
    assert freq[2] == 0 and freq[3] == 0  # outside the nucleus: 0.5 + 0.3 reaches 0.7
    assert abs(float(freq[0]) - 0.625) < 4 * math.sqrt(0.25 / n)
    tiny_p = SamplingParams(temperature=1.0, top_p=1e-9, seed=0)
    assert sample(x[0], tiny_p, make_generator(tiny_p)) == 0  # the top token always stays


def test_mixed_batch_with_given_greedy_tokens() -> None:
    x = _logits(4)
    params = [SamplingParams(), SamplingParams(temperature=0.8, seed=5), SamplingParams(), SamplingParams(temperature=1e-30)]
    greedy = greedy_tokens(x)
    got = sample_batch(x, params, [make_generator(p) for p in params], greedy=greedy)
    assert [got[0], got[2], got[3]] == [int(x[0].argmax()), int(x[2].argmax()), int(x[3].argmax())]
    with pytest.raises(ValueError, match="match"):
        sample_batch(x, params[:2], [None, None])
