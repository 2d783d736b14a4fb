"""Ship a model's tokenizer over HTTP, so the router never reads model files.

The router needs only the tokenizer. Reading it from a GGUF file means parsing the whole file
(~2.5 s for SmolLM2); a prefill instance already holds it, and its JSON form (~1.5 MB) rebuilds in
under 0.1 s. This also keeps the router and the engines on exactly the same vocabulary, and lets a
router on another host work with nothing but the instances' URLs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tokenizers

from hawk.engine.tokenizer import Tokenizer


def tokenizer_to_wire(tok: Tokenizer) -> dict[str, Any]:
    return {
        "tokenizer_json": tok.tok.to_str(),
        "bos_token": tok.bos_token,
        "eos_token": tok.eos_token,
        "eos_token_ids": list(tok.eos_token_ids),
        "chat_template": tok.chat_template,
    }


def tokenizer_from_wire(d: dict[str, Any]) -> Tokenizer:
    return Tokenizer(
        tokenizers.Tokenizer.from_str(d["tokenizer_json"]),
        bos_token=d.get("bos_token"),
        eos_token=d.get("eos_token"),
        eos_token_ids=d.get("eos_token_ids") or (),
        chat_template=d.get("chat_template"),
    )


def load_tokenizer(spec: str) -> Tokenizer:
    """The tokenizer of a model spec read locally (no weights): the fallback when no instance
    can send it, and for tools that only need to count tokens."""
    from hawk.engine.config import preset
    from hawk.engine.loader import EMBEDDED, RANDOM_PRESETS, embedded_path

    if spec in EMBEDDED:
        return Tokenizer.from_gguf(embedded_path(spec))
    if spec in RANDOM_PRESETS:
        return Tokenizer.byte_level(preset(spec))
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return Tokenizer.from_gguf(path)
    if path.is_dir():
        return Tokenizer.from_hf_dir(path)
    raise ValueError(f"cannot find a tokenizer for model {spec!r}")
