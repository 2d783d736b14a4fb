"""The benchmark's natural-text prompts: exact lengths, distinct starts, deterministic."""

from __future__ import annotations

import pytest

from hawk.bench.prompt_text import CORPUS, natural_prompt, sentences


def _words(text: str) -> list[int]:
    """A stand-in tokenizer: one id per word (the function only needs text -> ids)."""
    return [hash(w) % 50_000 for w in text.split()]


def test_prompts_have_exactly_n_tokens_even_past_the_corpus() -> None:
    n_words = len(CORPUS.split())
    for n in (1, 32, n_words + 100):  # the last wraps around the corpus
        assert len(natural_prompt(_words, n, 0, 4)) == n


def test_each_slot_starts_at_its_own_sentence() -> None:
    slots = 10
    heads = {tuple(natural_prompt(_words, 6, i, slots)) for i in range(slots)}
    assert len(heads) == slots  # no prompt is a prefix of another
    first = natural_prompt(_words, 3, 0, slots)
    assert first == _words(sentences()[0])[:3]
    assert natural_prompt(_words, 50, 3, slots) == natural_prompt(_words, 50, 3, slots)


def test_slot_out_of_range_and_too_many_slots_are_refused() -> None:
    with pytest.raises(ValueError, match="index"):
        natural_prompt(_words, 4, 5, 5)
    with pytest.raises(ValueError, match="sentences"):
        natural_prompt(_words, 4, 0, len(sentences()) + 1)
