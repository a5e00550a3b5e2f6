"""The engine's tokenizer without transformers on its start-up path.

The engine process tokenizes, detokenizes and reads a few special ids; it never renders a chat
template on its own (the server does). Loading the model's tokenizer through transformers costs
~2 s of its start (mostly importing transformers; Qwen2.5's tokenizer: 1.9 s) against 0.4 s for
the Rust `tokenizers` backend alone. `FastTokenizer` is that backend, saved once from the
transformers tokenizer it came from (so its normalizer, pre-tokenizer, added tokens and
post-processor are exactly that tokenizer's), with the calls the engine makes per request:

    encode(text, add_special_tokens)   decode(ids, skip_special_tokens, clean_up_tokenization_spaces)
    len(tok)   get_vocab()   convert_tokens_to_ids   eos/bos/pad token ids

Anything else (a chat template, the grammar backends' vocabulary inspection) goes to the
transformers tokenizer behind it, loaded on first use by `full()`.

The saved form lives in cache_root()/fast_tokenizers/, one JSON file per tokenizer folder
(keyed by the folder and its files' sizes and times, as the class memo of models.files), written
whole and renamed into place; an unreadable or foreign file is a miss.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

FORMAT = 1
# the clean-up transformers' decode applies when a tokenizer asks for it (tokenization_utils_base)
_CLEANUPS = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
             (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))
_PROBES = ("a . b , c ? d ! e 's f n't", "x 're y 've z 'm")


class FastTokenizer:
    """The model's tokenizer as the engine uses it (see the module docstring)."""

    def __init__(self, backend: Any, meta: dict[str, Any], load_full: Callable[[], Any]) -> None:
        self.backend = backend
        self.eos_token_id: int | None = meta["eos_token_id"]
        self.bos_token_id: int | None = meta["bos_token_id"]
        self.pad_token_id: int | None = meta["pad_token_id"]
        self.clean_up_tokenization_spaces: bool = meta["clean_up"]
        self._load_full = load_full
        self._full: Any = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: int | Sequence[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        text = self.backend.decode([ids] if isinstance(ids, int) else list(ids), skip_special_tokens=skip_special_tokens)
        clean = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None else clean_up_tokenization_spaces
        return clean_up(text) if clean else text

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self.backend.token_to_id(tokens)
        return [self.backend.token_to_id(t) for t in tokens]

    def full(self) -> Any:
        """The transformers tokenizer this one was saved from (loaded on the first call)."""
        if self._full is None:
            self._full = self._load_full()
        return self._full

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled (a grammar compile worker's factory) as the transformers tokenizer, which is
        what the worker's backends read."""
        return _same, (self.full(),)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "backend":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.full(), name)


def _same(x: Any) -> Any:
    return x


def clean_up(text: str) -> str:
    for a, b in _CLEANUPS:
        text = text.replace(a, b)
    return text


def save_fast(full: Any, path: Path) -> None:
    """Write the transformers tokenizer `full`'s backend and special ids to `path`."""
    backend = full.backend_tokenizer
    meta = {"format": FORMAT, "eos_token_id": full.eos_token_id, "bos_token_id": full.bos_token_id,
            "pad_token_id": full.pad_token_id, "clean_up": _cleans_up(full, backend), "backend": backend.to_str()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            json.dump(meta, f)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def load_fast(path: Path, load_full: Callable[[], Any]) -> FastTokenizer | None:
    """The tokenizer saved at `path`, or None (missing, damaged, or another format)."""
    try:
        meta = json.loads(path.read_text())
        if meta.get("format") != FORMAT:
            return None
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(meta["backend"])
        return FastTokenizer(_plain(backend), meta, load_full)
    except Exception:  # OSError, a JSON or key error, or the one tokenizers raises for a bad backend
        return None


def cache_path(root: Path, key: str) -> Path:
    return root / "fast_tokenizers" / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def _plain(backend: Any) -> Any:
    """transformers sets truncation and padding per call, off unless asked: the same here."""
    backend.no_truncation()
    backend.no_padding()
    return backend


def _cleans_up(full: Any, backend: Any) -> bool:
    """Whether `full.decode` cleans up spaces by default: asked of its decode (transformers 5 skips
    the clean-up for BPE models whatever the flag says), else the flag."""
    if not getattr(full, "clean_up_tokenization_spaces", False):
        return False
    for text in _PROBES:
        ids = backend.encode(text, add_special_tokens=False).ids
        raw = backend.decode(ids, skip_special_tokens=False)
        if clean_up(raw) != raw:
            return full.decode(ids, skip_special_tokens=False) != raw
    return True
