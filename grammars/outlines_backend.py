"""outlines-core: regex, choice, and JSON schema through its schema-to-regex."""

from __future__ import annotations

import json
import re
from functools import cache
from typing import Any

import torch

from grammars.base import Backend, Compiled, Matcher, check_backend
from grammars.spec import GrammarError, GrammarSpec


class OutlinesMatcher(Matcher):
    def __init__(self, index: Any, stop_ids: set[int]) -> None:
        from outlines_core import Guide

        self._g = Guide(index, max_rollback=64)
        self._stop = stop_ids
        self._done = False

    def accept(self, token: int) -> bool:
        if self._done:
            return False
        if token in self._stop:
            self._done = self._g.is_finished()
            return self._done
        try:
            self._g.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True

    def fill_bitmask(self, mask: torch.Tensor, row: int) -> None:
        r = mask[row]
        if self._done:
            r.zero_()
            return
        self._g.write_mask_into(r.data_ptr(), r.numel(), r.element_size())

    def is_terminated(self) -> bool:
        return self._done

    def rollback(self, n: int) -> None:
        if n and self._done:
            self._done, n = False, n - 1
        if n:
            self._g.rollback_state(n)

    def jump_forward(self) -> str:
        return ""  # the index knows tokens, not forced strings


class OutlinesCompiled(Compiled):
    backend = "outlines"

    def __init__(self, index: Any, stop_ids: set[int]) -> None:
        self._index, self._stop = index, stop_ids

    def serialize(self) -> bytes:
        _, (data,) = self._index.__reduce__()  # (Index.from_binary, (bytes,)): the bytes, not a pickle
        return bytes(data)

    def matcher(self) -> Matcher:
        return OutlinesMatcher(self._index, self._stop)


class OutlinesBackend(Backend):
    name = "outlines"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._stop = set(stop_token_ids)
        self._vocab: Any = None

    def _vocabulary(self) -> Any:
        if self._vocab is None:
            from outlines_core import Vocabulary

            self._vocab = Vocabulary(min(self._stop), token_bytes(self._tokenizer, self._stop))
        return self._vocab

    def deserialize(self, backend: str, data: bytes) -> Compiled:
        from outlines_core import Index

        check_backend(self.name, backend)
        try:
            return OutlinesCompiled(Index.from_binary(data), self._stop)
        except Exception as e:
            raise GrammarError(None, f"the compiled outlines index could not be loaded: {e}") from None

    def compile(self, spec: GrammarSpec) -> Compiled:
        from outlines_core import Index
        from outlines_core.json_schema import build_regex_from_schema

        try:
            if spec.kind == "json_schema":
                ws = spec.max_whitespace
                pattern = build_regex_from_schema(spec.source, None if ws is None else f"[ ]{{0,{ws}}}")
            elif spec.kind == "regex":
                pattern = spec.source
            elif spec.kind == "choice":
                pattern = "|".join(re.escape(o) for o in json.loads(spec.source))
            else:
                raise GrammarError(spec.kind, "not supported by the outlines backend")
            return OutlinesCompiled(Index(pattern, self._vocabulary()), self._stop)
        except GrammarError:
            raise
        except Exception as e:
            text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise GrammarError(spec.kind, f"outlines could not compile it: {text}") from None


@cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def token_bytes(tokenizer: Any, skip: set[int]) -> dict[bytes, list[int]]:
    """Each token's bytes (byte-level BPE or SentencePiece-style '▁' vocabularies)."""
    dec = _byte_decoder()
    special = set(getattr(tokenizer, "all_special_ids", ())) | skip
    out: dict[bytes, list[int]] = {}
    for token, i in tokenizer.get_vocab().items():
        if i in special:
            continue
        if all(c in dec for c in token):
            raw = bytes(dec[c] for c in token)
        elif re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token):
            raw = bytes([int(token[3:5], 16)])
        else:
            raw = token.replace("▁", " ").encode()
        out.setdefault(raw, []).append(i)
    return out
