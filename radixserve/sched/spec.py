"""Speculative drafts from context copies: n-gram lookup in the request's own tokens and in its
namespace's cached branches (what other requests forked off the same prefix went on to write).

Each step, for each decoding request, the longest suffix n-gram of its tokens (spec_ngram_max
down to spec_ngram_min) is looked up: first in its own prompt and output (the latest earlier
occurrence), then in the cached branches of its namespace (`PrefixCache.branches`). The tokens
that followed it are the draft. The engine feeds the draft after the request's pending token
and keeps the longest prefix the sampler itself would have produced (engine/runner.py), so the
output is exactly that of decoding without speculation.

How many draft tokens to feed is a cost model, per request and step: draft token j is accepted
with probability about alpha^j (alpha: the request's recent per-token acceptance, shrunk
towards the engine-wide rate for matches of that length), and costs one more row in a step of
B rows whose fixed part is F rows; it is worth feeding while alpha^j > B / (B + F). A batch of
many decodes is compute-bound (B / (B + F) near 1) and drafts stop by themselves; past
spec_max_batch they are not even looked up.

A draft is cut where the request could not use it: at the first token its grammar rejects,
after a token that ends the grammar or makes it force text (jump-forward runs after the
accepted tokens, as it would without speculation), after an EOS or stop token, at a stop
string, at max_new_tokens and at the context window. Tokens are searched as packed int32
bytes, so a lookup is a few `bytes.rfind` calls at C speed.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixserve.config import SpecConfig
from radixserve.request import Req
from radixserve.sched.cache_manager import CacheManager

_SEP = array("i", [-1]).tobytes()  # between cached runs: no token id is negative
_BRANCH_TOKENS = 4096  # most tokens of cached branches searched per request
_REFRESH_STEPS = 8  # a request re-reads the cached branches at most this often (when they changed)
_DECAY = 0.8  # a request's acceptance counts: weight of the past per verification
_PRIOR = 2.0  # pseudo-tokens of the engine-wide rate in a request's estimate
_GLOBAL_DECAY = 0.98


@dataclass
class _State:
    packed: bytearray = field(default_factory=bytearray)  # token_ids as int32, appended as they grow
    hits: float = 0.0  # accepted draft tokens (decayed)
    tries: float = 0.0  # draft tokens that were checked: accepted ones and the first rejected one
    branches: bytes = b""
    branches_version: int = -1
    branches_step: int = -(10**9)


Forced = Callable[[Any, int, int], list[int]]  # (matcher, last token, new tokens left) -> forced tokens, accepted


@dataclass
class Draft:
    tokens: list[int]
    ngram: int  # the length of the matched n-gram (the acceptance statistics are kept per length)
    from_cache: bool = False  # found in the namespace's cached branches, not in the request's own tokens
    forced_from: int | None = None  # tokens[forced_from:] are what jump-forward appends there: kept without a check


class NgramProposer:
    def __init__(self, cfg: SpecConfig, cache: CacheManager, eos_ids: set[int], context_len: int, fixed_cost_rows: float,
                 decode: Callable[[list[int]], str] | None = None, forced: Forced | None = None, max_rows: int = 1 << 30) -> None:
        """max_rows: most rows a step's decodes and drafts may take together (on a CPU, the
        native kernels' bound: past it a step computes every row another way, and its numbers
        would depend on the drafts)."""
        self.cfg = cfg
        self.max_rows = max_rows
        self.cache = cache
        self.eos_ids = frozenset(eos_ids)
        self.context_len = context_len
        self.fixed_cost_rows = fixed_cost_rows
        self.decode = decode  # the tokenizer's, to cut a draft at a stop string
        self.forced = forced  # the tokens jump-forward appends after a token (None: jump-forward is off)
        self.rate = [0.5] * (cfg.spec_ngram_max + 1)  # engine-wide acceptance per matched n-gram length
        self._states: dict[str, _State] = {}
        self._step = 0

    # -- proposing --------------------------------------------------------------------------
    def propose(self, req: Req, batch: int) -> Draft | None:
        """Draft tokens for `req` in a step where `batch` requests decode, or None."""
        if batch > self.cfg.spec_max_batch or (req.grammar is not None and not req.grammar_active):
            return None  # reasoning before the constraint starts: `grammar_after` must be seen per token
        st = self._states.setdefault(req.rid, _State())
        self._sync(st, req)
        room = min(self.cfg.spec_max_draft, req.remaining_new_tokens - 1, self.context_len - len(req.token_ids) - 1)
        if room < 1:
            return None
        found = self._lookup(st, req)
        if found is None:
            st.hits *= 0.95  # no draft this step: the estimate drifts back towards the engine-wide rate
            st.tries *= 0.95
            return None
        tokens, n, from_cache = found
        k = min(room, len(tokens), self._worth(st, n, batch))
        draft = Draft(tokens[:k], n, from_cache)
        self._cut(req, draft, room)
        return draft if draft.tokens else None

    def _worth(self, st: _State, n: int, batch: int) -> int:
        """Draft tokens worth a row each: the largest j with alpha^j > B / (B + F)."""
        alpha = (st.hits + _PRIOR * self.rate[n]) / (st.tries + _PRIOR)
        threshold = batch / (batch + self.fixed_cost_rows)
        if alpha <= threshold:
            return 0
        if alpha >= 0.999:
            return self.cfg.spec_max_draft
        return max(0, math.ceil(math.log(threshold) / math.log(alpha)) - 1)

    def _sync(self, st: _State, req: Req) -> None:
        have = len(st.packed) // 4
        if have > len(req.token_ids):  # never shrinks in practice; rebuild if it did
            st.packed, have = bytearray(), 0
        if have < len(req.token_ids):
            st.packed += array("i", req.token_ids[have:]).tobytes()

    def _lookup(self, st: _State, req: Req) -> tuple[list[int], int, bool] | None:
        """The tokens after the longest suffix n-gram's latest earlier occurrence: in the
        request's own tokens first, then in its namespace's cached branches."""
        tokens, buf = req.token_ids, st.packed
        size = len(tokens)
        branches = self._branches(st, req)
        for n in range(min(self.cfg.spec_ngram_max, size - 1), self.cfg.spec_ngram_min - 1, -1):
            pat = bytes(buf[4 * (size - n) :])
            pos = _aligned_rfind(buf, pat, 4 * (size - 1))
            if pos >= 0:
                start = pos // 4 + n
                return tokens[start : start + self.cfg.spec_max_draft], n, False
            if branches:
                pos = _aligned_find(branches, pat)
                if pos >= 0:
                    run = array("i")
                    run.frombytes(branches[pos + 4 * n : pos + 4 * (n + self.cfg.spec_max_draft)])
                    out = run.tolist()
                    out = out[: out.index(-1)] if -1 in out else out
                    if out:
                        return out, n, True
        return None

    def _branches(self, st: _State, req: Req) -> bytes:
        version = self.cache.prefix.version
        if version != st.branches_version and self._step - st.branches_step >= _REFRESH_STEPS:
            runs = self.cache.branches(req, self.cfg.spec_ngram_max, _BRANCH_TOKENS)
            st.branches = b"".join(array("i", r).tobytes() + _SEP for r in runs)
            st.branches_version, st.branches_step = version, self._step
        return st.branches

    def _cut(self, req: Req, d: Draft, room: int) -> None:
        """Cut the draft to what the request could use (see the module docstring)."""
        p, draft = req.params, d.tokens
        for i, t in enumerate(draft):
            if (t in self.eos_ids and not p.ignore_eos) or t in req.stop_ids:
                del draft[i + 1 :]
                break
        m = req.grammar
        if m is not None:
            ok, forced = 0, []
            for t in draft:
                if m.is_terminated() or not m.accept(t):
                    break
                ok += 1
                if m.is_terminated():
                    break
                if self.forced is not None and not p.return_logprob and m.jump_forward():
                    # jump-forward appends text here: draft its tokens too (kept unchecked, as it keeps them)
                    forced = self.forced(m, t, req.remaining_new_tokens - ok)
                    break
            m.rollback(ok + len(forced))  # every token it accepted, the forced ones too
            del draft[ok:]
            if forced[: room - ok]:
                d.forced_from = len(draft)
                draft += forced[: room - ok]
        stops = p.stop_strs
        decode = self.decode
        if stops and draft and decode is not None:
            tail = req.token_ids[-8:]
            before = decode(tail)
            counts = [before.count(s) for s in stops]

            def stops_in(j: int) -> bool:
                text = decode(tail + draft[:j])
                return any(text.count(s) > c for s, c in zip(stops, counts))

            if stops_in(len(draft)):
                j = 1
                while not stops_in(j):
                    j += 1
                del draft[j:]
                if d.forced_from is not None and d.forced_from >= j:
                    d.forced_from = None

    # -- after the step ---------------------------------------------------------------------
    def observe(self, req: Req, draft: Draft, accepted: int) -> None:
        """How much of a draft the model kept: the request's and the engine-wide estimates."""
        st = self._states.get(req.rid)
        tried = accepted + (1 if accepted < len(draft.tokens) else 0)
        if st is not None:
            st.hits = st.hits * _DECAY + accepted
            st.tries = st.tries * _DECAY + tried
        if tried:
            g = self.rate[draft.ngram]
            for j in range(tried):
                g = g * _GLOBAL_DECAY + (1 - _GLOBAL_DECAY) * (1.0 if j < accepted else 0.0)
            self.rate[draft.ngram] = g

    def end_step(self) -> None:
        self._step += 1

    def release(self, rid: str) -> None:
        self._states.pop(rid, None)


def _aligned_rfind(buf: bytearray, pat: bytes, end: int) -> int:
    """The last 4-byte-aligned occurrence of pat in buf[:end], or -1."""
    while True:
        pos = buf.rfind(pat, 0, end)
        if pos < 0 or pos % 4 == 0:
            return pos
        end = pos + len(pat) - 1


def _aligned_find(buf: bytes, pat: bytes) -> int:
    pos = buf.find(pat)
    while pos >= 0 and pos % 4:
        pos = buf.find(pat, pos + 1)
    return pos
