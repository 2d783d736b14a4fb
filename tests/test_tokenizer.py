"""Tokenizers from GGUF metadata, tokenizer.json and bytes; chat templates; streaming decode."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hawk.engine.config import PRESETS, preset
from hawk.engine.loader import RANDOM_PRESETS, embedded_path
from hawk.engine.tokenizer import CHATML_TEMPLATE, MAX_HELD_TOKENS, Tokenizer

TEXTS = [
    "What is the capital of France?",
    "Prices: 12345 apples, 3.14159 pies; 2024-06-01.",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "héllo wörld — naïve café, 日本語のテキスト, emoji 🦅🇫🇷 and ∑∫√",
    "",
]


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    return Tokenizer.from_gguf(embedded_path())


@pytest.fixture(scope="module")
def byte_tok() -> Tokenizer:
    return Tokenizer.byte_level(preset("tiny"))


@pytest.mark.parametrize("text", TEXTS)
def test_gguf_round_trip(smol: Tokenizer, text: str) -> None:
    assert smol.decode(smol.encode(text)) == text


def test_gguf_known_pieces(smol: Tokenizer) -> None:
    ids = smol.encode("What is the capital of France?")
    assert [smol.id_to_token(i) for i in ids] == [
        "What", "Ġis", "Ġthe", "Ġcapital", "Ġof", "ĠFrance", "?",
    ]
    # the "smollm" pre-tokenizer splits numbers into single digits
    assert [smol.decode([i]) for i in smol.encode("2024")] == ["2", "0", "2", "4"]


def test_gguf_special_tokens_are_single_ids(smol: Tokenizer) -> None:
    assert smol.encode("<|im_start|>") == [1]
    assert smol.encode("<|im_end|>") == [2]
    assert smol.encode("<|endoftext|>") == [0]
    ids = smol.encode("<|im_start|>user\nhi<|im_end|>\n")
    assert ids[0] == 1 and ids[-2] == 2
    assert smol.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>\n"
    assert smol.decode(ids) == "user\nhi\n"


def test_gguf_end_tokens_and_bos(smol: Tokenizer) -> None:
    assert set(smol.eos_token_ids) == {0, 2}
    assert smol.eos_token_ids[0] == 2  # the declared eos first
    assert smol.bos_token_id == 1
    assert smol.vocab_size == 49152
    # SmolLM2's GGUF says add_bos_token = false
    assert smol.encode("hi", add_special_tokens=True) == smol.encode("hi")


def test_gguf_chat_template(smol: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    text = smol.apply_chat_template(msgs)
    assert text.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert text.startswith("<|im_start|>system\n")  # the template's default system prompt
    no_gen = smol.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        add_generation_prompt=False,
    )
    assert no_gen == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    text_parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    parts = smol.apply_chat_template([{"role": "user", "content": text_parts}])
    assert "<|im_start|>user\nab<|im_end|>" in parts


@pytest.mark.parametrize(
    "messages",
    [[{"content": "no role"}], ["just a string"], [{"role": "user", "content": 5}],
     [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]],
)
def test_bad_messages_raise_value_error(smol: Tokenizer, messages: list) -> None:
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        smol.apply_chat_template(messages)


def test_template_raise_exception_becomes_value_error(byte_tok: Tokenizer) -> None:
    t = Tokenizer(
        byte_tok.tok,
        chat_template="{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('first message must be from the user') }}{% endif %}ok",
    )
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(ValueError, match="first message must be from the user"):
        t.apply_chat_template([{"role": "assistant", "content": "x"}])
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(byte_tok.tok).apply_chat_template([{"role": "user", "content": "x"}])


def test_template_is_sandboxed(byte_tok: Tokenizer) -> None:
    t = Tokenizer(byte_tok.tok, chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(ValueError):
        t.apply_chat_template([{"role": "user", "content": "x"}])


def _stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    dec = tok.incremental_decoder()
    return [dec.step(i) for i in ids]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_decoder_streams_whole_characters(smol: Tokenizer, text: str) -> None:
    pieces = _stream(smol, smol.encode(text))
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_incremental_decoder_holds_back_split_characters(byte_tok: Tokenizer) -> None:
    ids = byte_tok.encode("a🦅b")  # the eagle is four byte tokens
    assert len(ids) == 6
    assert _stream(byte_tok, ids) == ["a", "", "", "", "🦅", "b"]
    # special tokens are skipped by default
    assert "".join(_stream(byte_tok, byte_tok.encode("x<|im_end|>y"))) == "xy"


@pytest.mark.parametrize("text", TEXTS)
def test_byte_level_round_trip(byte_tok: Tokenizer, text: str) -> None:
    ids = byte_tok.encode(text)
    assert ids == list(text.encode())
    assert byte_tok.decode(ids) == text


@settings(max_examples=60, deadline=None)
@given(text=st.text(st.characters(blacklist_categories=("Cc", "Cs"), max_codepoint=0x3FFFF)))
def test_round_trip_any_text(smol: Tokenizer, text: str) -> None:
    # SmolLM2's vocabulary lacks a few bytes (controls 0x04, 0x06, 0x13, ...; UTF-8 lead bytes
    # 0xF1-0xF4 of planes 4-16), and BPE without an unknown token drops them, as upstream does.
    assert smol.decode(smol.encode(text), skip_special_tokens=False) == text


@pytest.mark.parametrize("name", RANDOM_PRESETS)
def test_byte_level_specials_fit_each_preset(name: str) -> None:
    cfg = PRESETS[name]
    tok = Tokenizer.byte_level(cfg)
    assert tok.vocab_size <= cfg.vocab_size
    assert tok.bos_token_id == cfg.bos_token_id
    assert set(cfg.eos_token_ids) <= set(tok.eos_token_ids)
    chat = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))
    assert chat[0] == tok.token_to_id("<|im_start|>")
    assert tok.token_to_id("<|im_end|>") in tok.eos_token_ids


def test_byte_level_needs_room_for_specials() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        Tokenizer.byte_level(preset("tiny").replace(vocab_size=259))
    with pytest.raises(ValueError, match="two eos"):
        Tokenizer.byte_level(preset("tiny").replace(eos_token_ids=(257,)))


def test_hf_tokenizer_json_round_trip(tmp_path: Path, smol: Tokenizer) -> None:
    smol.tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<|im_start|>"},  # the dict form transformers also writes
        "eos_token": "<|im_end|>",
        "chat_template": CHATML_TEMPLATE,
    }))
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 0]}')
    hf = Tokenizer.from_hf_dir(tmp_path)
    for text in TEXTS:
        assert hf.encode(text) == smol.encode(text)
    assert hf.eos_token_ids == (2, 0)
    assert hf.bos_token_id == 1
    msgs = [{"role": "user", "content": "Hi"}]
    assert hf.apply_chat_template(msgs) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_hf_dir_without_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer.from_hf_dir(tmp_path)


# ---- streaming detokenisation: hold only what may still become a character -------------------


def _deltas(tok: Tokenizer, ids: list[int], skip: bool = True) -> list[str]:
    dec = tok.incremental_decoder(skip)
    return [dec.step(i) for i in ids] + [dec.flush()]


@pytest.mark.parametrize("text", ["é", "€", "🦅", "a€b🦅c日本"])
def test_multibyte_characters_split_over_byte_tokens(byte_tok: Tokenizer, text: str) -> None:
    ids = byte_tok.encode(text)
    pieces = _deltas(byte_tok, ids)
    assert "".join(pieces) == text and "\ufffd" not in "".join(pieces)
    # each character comes out with its last byte, not later
    dec, out = byte_tok.incremental_decoder(), []
    for i in ids:
        out.append(dec.step(i))
    assert [p for p in out if p] == [c for c in text]


def test_invalid_bytes_come_out_at_once_as_replacement(byte_tok: Tokenizer) -> None:
    # 0xFF can never start a character; a lone continuation byte neither
    assert _deltas(byte_tok, [0xFF]) == ["\ufffd", ""]
    assert _deltas(byte_tok, [0x80, 0x80, 0x41]) == ["\ufffd", "\ufffd", "A", ""]
    # a lead byte followed by a non-continuation: the lead is replaced when the next byte shows it
    assert _deltas(byte_tok, [0xE2, 0x41]) == ["", "\ufffdA", ""]
    # random bytes stream without waiting for a valid character to turn up
    stream = _deltas(byte_tok, [0xC0, 0xFE, 0xF5, 0xFF])
    assert all(stream[:4]) and "".join(stream) == byte_tok.decode([0xC0, 0xFE, 0xF5, 0xFF])


def test_an_unfinished_character_is_flushed_at_the_end(byte_tok: Tokenizer) -> None:
    assert _deltas(byte_tok, [0x41, 0xF0, 0x9F]) == ["A", "", "", "\ufffd"]
    assert "".join(_deltas(byte_tok, [0x41, 0xF0, 0x9F])) == byte_tok.decode([0x41, 0xF0, 0x9F])


@pytest.mark.parametrize("name", RANDOM_PRESETS)
def test_every_id_of_a_preset_decodes_to_text(name: str) -> None:
    """A random model samples the whole vocabulary: ids past the bytes and specials must stream
    visible text, or a 128k-vocabulary preset streams nothing until the end."""
    cfg = PRESETS[name]
    tok = Tokenizer.byte_level(cfg)
    assert tok.vocab_size == cfg.vocab_size
    specials = {tok.bos_token_id, *tok.eos_token_ids, tok.token_to_id("<|im_start|>")}
    for i in (256, 300, cfg.vocab_size // 2, cfg.vocab_size - 1):
        if i not in specials:
            assert _deltas(tok, [i])[0] == tok.decode([i]) != ""
    assert tok.encode("<300>") == list(b"<300>")  # placeholders never come out of encode


@pytest.mark.parametrize("which", ["tiny", "llama-3.1-8b", "smol"])
def test_deltas_concatenate_to_decode_on_random_ids(smol: Tokenizer, which: str) -> None:
    import random

    tok = smol if which == "smol" else Tokenizer.byte_level(preset(which))
    rng = random.Random(0)
    for _ in range(200):
        hi = rng.choice([300, tok.vocab_size])  # mostly bytes, or the whole vocabulary
        ids = [rng.randrange(hi) for _ in range(rng.randrange(1, 25))]
        for skip in (True, False):
            assert "".join(_deltas(tok, ids, skip)) == tok.decode(ids, skip), ids


def _byte_fallback_tokenizer() -> Tokenizer:
    """A SentencePiece-style vocabulary (``<0xNN>`` byte pieces, ``▁`` for spaces) whose decoder
    is not ``ByteLevel``: the re-decoding path."""
    from tokenizers import decoders, models
    import tokenizers

    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    vocab.update({"▁hi": 256, "▁there": 257, "<unk>": 258})
    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    return Tokenizer(tok)


def test_byte_fallback_decoder_streams_and_flushes() -> None:
    tok = _byte_fallback_tokenizer()
    euro = list("€".encode())
    ids = [256, *euro, 257, 0xFF, 0x41, 0xE2, 0x82]
    pieces = _deltas(tok, ids)
    assert "".join(pieces) == tok.decode(ids)
    assert pieces[0] == " hi" and pieces[1:4] == ["", "", "€"] and pieces[4] == " there"
    # invalid bytes are held a bounded number of tokens, never until the end
    held = _deltas(tok, [0xFF] * 8)
    assert any(held[:MAX_HELD_TOKENS]) and "".join(held) == tok.decode([0xFF] * 8)
    # an unfinished character is flushed when the sequence ends
    tail = _deltas(tok, [256, 0xE2, 0x82])
    assert tail[:3] == [" hi", "", ""] and tail[3] and set(tail[3]) == {"\ufffd"}
