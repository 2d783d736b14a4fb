"""Text <-> token ids, chat templates, and streaming detokenisation.

One ``Tokenizer`` over the ``tokenizers`` library whatever the source: a GGUF file's
metadata, a Hugging Face ``tokenizer.json``, or a byte-level vocabulary for the randomly
initialised presets. The engine only ever sees this class.
"""

from __future__ import annotations

import codecs
import datetime
import json
from collections.abc import Iterable, Sequence
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors

from hawk.engine.config import ModelConfig

# Control tokens that end a turn or a document in common vocabularies. GGUF files name a single
# eos id, but chat models stop on any of these (SmolLM2: <|im_end|> and <|endoftext|>).
END_TOKENS = frozenset({
    "<|endoftext|>", "<|im_end|>", "<|end_of_text|>", "<|eot_id|>", "<|eom_id|>",
    "<end_of_turn>", "<|end|>", "</s>",
})

# GGUF token types (llama.cpp's llama_token_type).
_GGUF_CONTROL, _GGUF_USER_DEFINED = 3, 4

# Pre-tokenizer regex of Llama-3 ("llama-bpe" in GGUF).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class Tokenizer:
    """Encode, decode and chat-format for one model."""

    def __init__(
        self,
        tok: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
    ) -> None:
        self.tok = tok
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        ids = list(eos_token_ids)
        if eos_token is not None and (i := tok.token_to_id(eos_token)) is not None:
            ids.insert(0, i)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))  # dedupe, keep order

    # ---- basic API -------------------------------------------------------------------------

    @cached_property
    def vocab_size(self) -> int:
        """One past the largest id (ids may have gaps, e.g. specials placed at config ids)."""
        return max(self.tok.get_vocab(with_added_tokens=True).values()) + 1

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self.tok.token_to_id(self.bos_token)

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self.tok.id_to_token(i)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (``<|im_start|>``) map to
        their single ids. ``add_special_tokens`` adds what the tokenizer's post-processor adds
        (usually BOS), which chat templates normally already write themselves."""
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens)

    def token_bytes(self, i: int, skip_special_tokens: bool = True) -> bytes:
        """The bytes one token contributes to ``decode`` under a ``ByteLevel`` decoder: unknown
        ids and (when skipped) special tokens give none; a piece written in the byte alphabet
        maps back byte by byte, any other piece (an added token) is its own UTF-8."""
        piece = self.tok.id_to_token(int(i))
        if piece is None or (skip_special_tokens and int(i) in self._special_ids):
            return b""
        table = _unicode_to_bytes()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return piece.encode("utf-8")

    @cached_property
    def _special_ids(self) -> frozenset[int]:
        return frozenset(i for i, t in self.tok.get_added_tokens_decoder().items() if t.special)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render messages with the model's own (sandboxed) Jinja chat template.

        Errors (a malformed message, a template's ``raise_exception``) become ``ValueError`` so
        the server can answer them with a 4xx.
        """
        if self.chat_template is None:
            raise ValueError("this model has no chat template; use plain completions")
        msgs = [_normalize_message(m, i) for i, m in enumerate(messages)]
        try:
            return _compile_template(self.chat_template).render(
                messages=msgs,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **extra,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template: {e}") from None

    # ---- constructors ----------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, reader_or_path: Any) -> Tokenizer:
        """Rebuild the tokenizer a GGUF file describes in its ``tokenizer.*`` metadata.

        Only byte-level BPE ("gpt2") vocabularies are supported; the pre-tokenizer follows
        ``tokenizer.ggml.pre`` the way llama.cpp does for the names listed below.
        """
        import gguf  # local: the HF and byte paths should not need it

        reader = (
            reader_or_path
            if isinstance(reader_or_path, gguf.GGUFReader)
            else gguf.GGUFReader(reader_or_path)
        )

        def field(key: str, default: Any = None) -> Any:
            f = reader.fields.get(key)
            return default if f is None else f.contents()

        kind = field("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(
                f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')"
            )
        tokens: list[str] = field("tokenizer.ggml.tokens")
        types: list[int] = field("tokenizer.ggml.token_type") or [1] * len(tokens)
        merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges", [])]
        tok = tokenizers.Tokenizer(
            models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges)
        )
        tok.pre_tokenizer = _gguf_pre_tokenizer(field("tokenizer.ggml.pre", "default"))
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types) if ty == _GGUF_CONTROL
        ])
        tok.add_tokens([
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types) if ty == _GGUF_USER_DEFINED
        ])

        def token(key: str) -> str | None:
            i = field(key)
            return None if i is None or not 0 <= i < len(tokens) else tokens[i]

        bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
        if bos is not None and field("tokenizer.ggml.add_bos_token", False):
            tok.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A",
                pair=f"{bos} $A {bos} $B",
                special_tokens=[(bos, tokens.index(bos))],
            )
        eot = field("tokenizer.ggml.eot_token_id")
        ends = [i for i, (t, ty) in enumerate(zip(tokens, types))
                if ty == _GGUF_CONTROL and t in END_TOKENS]
        return cls(
            tok,
            bos_token=bos,
            eos_token=eos,
            eos_token_ids=([eot] if eot is not None else []) + ends,
            chat_template=field("tokenizer.chat_template"),
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """``tokenizer.json`` plus what ``tokenizer_config.json`` / ``generation_config.json`` say
        about bos, eos and the chat template."""
        path = Path(path)
        tj = path / "tokenizer.json"
        if not tj.is_file():
            raise ValueError(f"{path}: no tokenizer.json (the only tokenizer format supported)")
        tok = tokenizers.Tokenizer.from_file(str(tj))
        tc = _read_json(path / "tokenizer_config.json")
        gen = _read_json(path / "generation_config.json")
        eos_ids = gen.get("eos_token_id", [])
        eos_ids = eos_ids if isinstance(eos_ids, list) else [eos_ids]
        return cls(
            tok,
            bos_token=_token_text(tc.get("bos_token")),
            eos_token=_token_text(tc.get("eos_token")),
            eos_token_ids=[int(i) for i in eos_ids],
            chat_template=_hf_chat_template(path, tc),
        )

    @classmethod
    def byte_level(cls, cfg: ModelConfig) -> Tokenizer:
        """One token per UTF-8 byte (ids 0-255) plus a few specials, for random-weight presets.

        Specials sit at the config's own ids so the model's bos/eos agree with the tokenizer:
        ``<|begin_of_text|>`` = bos, ``<|end_of_text|>`` = first eos, ``<|im_end|>`` = last eos
        (the end of a chat turn), ``<|im_start|>`` = the lowest free id from 256.

        Every other id up to ``vocab_size`` decodes to a placeholder piece ``<id>``. A random
        model samples the whole vocabulary; were those ids unknown, they would decode to nothing
        and a 128k-vocabulary preset would stream no text at all until the end. Encoding never
        produces a placeholder (there are no merges: text always encodes byte by byte).
        """
        if cfg.bos_token_id is None or len(cfg.eos_token_ids) < 2:
            raise ValueError("byte-level tokenizer needs a bos_token_id and two eos_token_ids")
        specials = {"<|begin_of_text|>": cfg.bos_token_id, "<|end_of_text|>": cfg.eos_token_ids[0]}
        for k, i in enumerate(cfg.eos_token_ids[1:-1], start=1):
            specials[f"<|eos_{k}|>"] = i
        specials["<|im_end|>"] = cfg.eos_token_ids[-1]
        used = set(specials.values())
        specials["<|im_start|>"] = next(i for i in range(256, cfg.vocab_size + 1) if i not in used)
        ids = list(specials.values())
        if min(ids) < 256 or len(set(ids)) != len(ids) or max(ids) >= cfg.vocab_size:
            raise ValueError(
                f"byte-level tokenizer: special ids {specials} must be distinct, >= 256 and "
                f"< vocab_size ({cfg.vocab_size})"
            )
        vocab = {c: b for b, c in _bytes_to_unicode().items()}
        vocab.update(specials)
        taken = set(ids)
        vocab.update({_placeholder(i): i for i in range(256, cfg.vocab_size) if i not in taken})
        tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        return cls(
            tok,
            bos_token="<|begin_of_text|>",
            eos_token="<|end_of_text|>",
            eos_token_ids=cfg.eos_token_ids,
            chat_template=CHATML_TEMPLATE,
        )


#: Tokens the text path holds while its text ends in U+FFFD before it gives up waiting: a
#: UTF-8 character is at most 4 bytes and every byte-carrying token carries at least one.
MAX_HELD_TOKENS = 4


class IncrementalDecoder:
    """Streams text as tokens arrive, holding back only what may still become a character.

    Byte-level BPE splits multi-byte characters over tokens. For those vocabularies (the
    ``ByteLevel`` decoder: GGUF, Llama-3-style ``tokenizer.json``, the random presets) each
    token's bytes go through an incremental UTF-8 decoder: an incomplete but valid trailing
    sequence (at most 3 bytes) waits for the next token, and bytes that can never form a
    character come out at once as U+FFFD. The deltas therefore concatenate to exactly
    ``decode(ids)``. Other decoders (SentencePiece with byte fallback) are streamed by
    re-decoding a short window of recent tokens, waiting at most ``MAX_HELD_TOKENS`` tokens on
    a trailing U+FFFD. Call :meth:`flush` when the sequence ends.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._bytes = isinstance(tokenizer.tok.decoder, decoders.ByteLevel)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list[int] = []  # text path: the window [prefix:] is re-decoded
        self._prefix = 0
        self._read = 0

    def step(self, token_id: int) -> str:
        """The text this token adds ("" while a character is still partial)."""
        if self._bytes:
            return self._utf8.decode(self._tok.token_bytes(int(token_id), self._skip))
        self._ids.append(int(token_id))
        return self._window_text(final=False)

    def flush(self) -> str:
        """What is still held when the sequence ends (an unfinished character becomes U+FFFD)."""
        if self._bytes:
            return self._utf8.decode(b"", final=True)
        return self._window_text(final=True)

    def _window_text(self, final: bool) -> str:
        ids = self._ids
        if self._read == len(ids):
            return ""
        before = self._tok.decode(ids[self._prefix:self._read], self._skip)
        text = self._tok.decode(ids[self._prefix:], self._skip)
        held = len(ids) - self._read
        if not final and text.endswith("\ufffd") and held < MAX_HELD_TOKENS:
            return ""  # maybe half a character: wait for the next token
        if not final and len(text) <= len(before) and held < MAX_HELD_TOKENS:
            return ""  # nothing visible yet (a skipped special, or a decoder still deciding)
        self._prefix, self._read = self._read, len(ids)
        return text[len(before):]


def _gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("default", "gpt2", "gpt-2"):
        return byte_level
    if pre == "smollm":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("llama-bpe", "llama3"):
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(tokenizers.Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    raise ValueError(
        f"GGUF tokenizer.ggml.pre {pre!r} is not supported "
        "(known: default, gpt2, smollm, llama-bpe)"
    )


@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    return {c: b for b, c in _bytes_to_unicode().items()}


def _placeholder(i: int) -> str:
    """The visible piece of a byte-level preset's id that is neither a byte nor a special."""
    return f"<{i}>"


def _normalize_message(m: Any, i: int) -> dict[str, Any]:
    """Check a chat message and flatten OpenAI-style content parts to one string."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise ValueError(f"messages[{i}] must be an object with a string 'role'")
    content = m.get("content")
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
            raise ValueError(f"messages[{i}].content: only text parts are supported")
        content = "".join(texts)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
    return {**m, "content": content}


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    # trim_blocks / lstrip_blocks: chat templates are written for these (as in transformers).
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


def _read_json(p: Path) -> dict[str, Any]:
    return json.loads(p.read_text()) if p.is_file() else {}


def _token_text(t: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(t, dict):
        return t.get("content")
    return t if isinstance(t, str) else None


def _hf_chat_template(path: Path, tc: dict[str, Any]) -> str | None:
    t = tc.get("chat_template")
    if isinstance(t, list):  # named templates: take "default"
        t = next((x["template"] for x in t if x.get("name") == "default"), None)
    if t is None and (path / "chat_template.jinja").is_file():
        t = (path / "chat_template.jinja").read_text()
    if t is None:
        t = _read_json(path / "chat_template.json").get("chat_template")
    return t
