"""Sampling: logit bias, penalties, temperature, top-k / top-p / min-p, per-request seeds, logprobs.

Logprobs are those of the model's own distribution (log-softmax of the raw logits), before
logit bias, penalties and temperature, as vLLM reports them. A request with a seed owns a generator,
so its samples do not depend on what else is in the batch.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from radixserve.request import Req, TokenLogprob


def _grammar_states(reqs: Sequence[Req], drafts: Sequence[Sequence[int]]) -> Iterator[tuple[int, Any]]:
    """(row, its matcher in the row's state) for each constrained row: a draft's rows (one
    request's, consecutive) see the matcher advanced through the draft tokens before them, and
    it is rolled back after. A row the matcher cannot reach (a draft token it refuses, or a
    finished grammar) is skipped: the rows before it refuse that token, so its sample is never
    kept."""
    i = 0
    while i < len(reqs):
        req = reqs[i]
        j = i + 1
        while j < len(reqs) and reqs[j] is req:
            j += 1
        if req.grammar is not None and req.grammar_active:
            m, advanced = req.grammar, 0
            try:
                for row in range(i, j):
                    draft = drafts[row]
                    while advanced < len(draft) and not m.is_terminated() and m.accept(draft[advanced]):
                        advanced += 1
                    if advanced < len(draft) or (draft and m.is_terminated()):
                        break
                    yield row, m
            finally:
                if advanced:
                    m.rollback(advanced)
        i = j


def _plain(r: Req) -> bool:
    """Nothing changes this request's logits before it samples: no bias, penalty, token
    held back by min_new_tokens, nor grammar (what _apply_bias, _apply_penalties and
    _apply_grammars would touch)."""
    p = r.params
    return (not r.bias_ids and p.repetition_penalty == 1.0 and not p.frequency_penalty and not p.presence_penalty
            and r.output_len >= p.min_new_tokens and (r.grammar is None or not r.grammar_active))


def argmax_rows(x: torch.Tensor) -> list[int]:
    """Each row's argmax (the first of equal maxima, as torch's). On CPU numpy's, vectorized
    along the row: about 10 us for a row of Qwen2.5's 151,936 logits, where torch's argmax takes
    about 230 (2-core Xeon, one thread each)."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        return [int(np.argmax(row)) for row in x.numpy()]
    return [int(t) for t in x.argmax(dim=-1).tolist()]


def logprob_entries(logits: torch.Tensor, tokens: Sequence[int], top_n: Sequence[int]) -> list[TokenLogprob]:
    """One TokenLogprob per row: the chosen token's logprob and the row's top_n[i] best."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
    k = max(top_n, default=0)
    tops_v, tops_i = (lp.topk(k, dim=-1) if k else (None, None))
    out = []
    for i, tok in enumerate(tokens):
        top = []
        if top_n[i]:
            assert tops_v is not None and tops_i is not None
            top = list(zip(tops_v[i, : top_n[i]].tolist(), tops_i[i, : top_n[i]].tolist()))
        out.append(TokenLogprob(int(tok), chosen[i], top))
    return out


class Sampler:
    def __init__(self, vocab_size: int, eos_ids: set[int], mask_words: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.mask_words = mask_words or (vocab_size + 31) // 32  # grammar bitmask width (the model's vocabulary)
        self.eos_ids = sorted(eos_ids)
        self._generators: dict[str, torch.Generator] = {}

    def release(self, rid: str) -> None:
        self._generators.pop(rid, None)

    def _generator(self, req: Req, device: torch.device) -> torch.Generator:
        g = self._generators.get(req.rid)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(req.params.seed if req.params.seed is not None else random.getrandbits(63))
            self._generators[req.rid] = g
        return g

    def sample(
        self, logits: torch.Tensor, reqs: Sequence[Req], masks: tuple[list[int], torch.Tensor] | None = None,
        drafts: Sequence[Sequence[int]] | None = None,
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        """logits: (len(reqs), vocab) float32; rows beyond `vocab_size` (padding) are never chosen.
        A request may own several consecutive rows (a speculative draft's): `drafts[i]` are the
        draft tokens before row i, so its penalties and grammar mask are those after them."""
        logits = logits[:, : self.vocab_size]
        raw = logits
        drafts = drafts if drafts is not None else [()] * len(reqs)
        want_lp = [i for i, r in enumerate(reqs) if r.params.return_logprob]
        if not all(_plain(r) for r in reqs):  # (rows that nothing changes are read in place: no copy)
            logits = self._apply_penalties(_apply_bias(logits.clone(), reqs), reqs, drafts)
            self._apply_grammars(logits, reqs, masks, drafts)
        out = [0] * len(reqs)
        greedy = [i for i, r in enumerate(reqs) if r.params.greedy]
        if greedy:
            picked = argmax_rows(logits if len(greedy) == len(reqs) else logits[torch.tensor(greedy, device=logits.device)])
            for i, t in zip(greedy, picked):
                out[i] = t
            if any(reqs[i].grammar is not None and reqs[i].grammar_active for i in greedy):
                self._greedy_grammar_rows(logits, reqs, drafts, out)
        sampled = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if sampled:
            probs = self._probs([reqs[i] for i in sampled], logits[torch.tensor(sampled, device=logits.device)])
            for j, i in enumerate(sampled):
                g = self._generator(reqs[i], logits.device)
                out[i] = int(torch.multinomial(probs[j], 1, generator=g)[0])
        lps: list[TokenLogprob | None] = [None] * len(reqs)
        if want_lp:
            entries = logprob_entries(
                raw[torch.tensor(want_lp, device=raw.device)],
                [out[i] for i in want_lp],
                [reqs[i].params.top_logprobs_num for i in want_lp],
            )
            for i, e in zip(want_lp, entries):
                lps[i] = e
        return out, lps

    def grammar_masks(self, reqs: Sequence[Req], drafts: Sequence[Sequence[int]] | None = None) -> tuple[list[int], torch.Tensor]:
        """The bitmask of the constrained rows that sample (the runner calls this on a helper
        thread while the model runs): greedy rows need none up front, `sample` checks their
        argmax against the matcher and masks only a row whose argmax the grammar refuses."""
        drafts = drafts if drafts is not None else [()] * len(reqs)
        rows: list[int] = []
        mask = torch.zeros(len(reqs), self.mask_words, dtype=torch.int32)
        for row, m in _grammar_states(reqs, drafts):
            if not reqs[row].params.greedy:
                m.fill_bitmask(mask, len(rows))
                rows.append(row)
        return rows, mask[: len(rows)]

    def _greedy_grammar_rows(self, logits: torch.Tensor, reqs: Sequence[Req], drafts: Sequence[Sequence[int]],
                             tokens: list[int]) -> None:
        """A constrained greedy row's argmax stands if its grammar accepts it (masking only
        removes tokens, so the masked argmax is the same); a row whose argmax it refuses is
        masked and its argmax taken again. Exact, and most rows skip the bitmask (~2 ms each on
        SmolLM2's vocabulary)."""
        picked = list(tokens)
        for row, m in _grammar_states(reqs, drafts):
            if not reqs[row].params.greedy:
                continue
            if m.accept(picked[row]):
                m.rollback(1)
                continue
            mask = torch.zeros(1, self.mask_words, dtype=torch.int32)
            m.fill_bitmask(mask, 0)
            from radixserve_kernels.bitmask import apply_bitmask

            apply_bitmask(logits, mask.to(logits.device), torch.tensor([row], device=logits.device))
            tokens[row] = argmax_rows(logits[row : row + 1])[0]

    def _apply_grammars(self, logits: torch.Tensor, reqs: Sequence[Req], masks: tuple[list[int], torch.Tensor] | None,
                        drafts: Sequence[Sequence[int]]) -> None:
        """One copy of the mask to the device; the kernel masks only the constrained rows."""
        rows, mask = masks if masks is not None else self.grammar_masks(reqs, drafts)
        if not rows:
            return
        from radixserve_kernels.bitmask import apply_bitmask

        apply_bitmask(logits, mask.to(logits.device), torch.tensor(rows, device=logits.device))

    def _apply_penalties(self, logits: torch.Tensor, reqs: Sequence[Req], drafts: Sequence[Sequence[int]]) -> torch.Tensor:
        for i, r in enumerate(reqs):
            p, extra = r.params, list(drafts[i])
            out_len = r.output_len + len(extra)
            if out_len < p.min_new_tokens and not (r.grammar is not None and r.grammar_active):  # a grammar decides
                banned = ([] if p.ignore_eos else self.eos_ids) + list(p.stop_token_ids or [])
                if banned:
                    logits[i, banned] = float("-inf")
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(r.token_ids).union(extra)), device=logits.device)
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if (p.frequency_penalty or p.presence_penalty) and out_len:
                counts = torch.bincount(torch.tensor(r.output_ids + extra, device=logits.device), minlength=logits.shape[1])
                counts = counts[: logits.shape[1]].to(logits.dtype)
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        return logits

    @staticmethod
    def _probs(reqs: Sequence[Req], logits: torch.Tensor) -> torch.Tensor:
        dev = logits.device
        temp = torch.tensor([r.params.temperature for r in reqs], device=dev, dtype=logits.dtype)
        logits = logits / temp[:, None]
        if any(r.params.top_k > 0 or r.params.top_p < 1.0 or r.params.min_p > 0 for r in reqs):
            logits = _filter(logits, reqs)
        return torch.softmax(logits, dim=-1)


def _apply_bias(logits: torch.Tensor, reqs: Sequence[Req]) -> torch.Tensor:
    """Each row's request's logit_bias, added in place (one scatter for the batch): every row of
    a request, draft rows included, carries the same bias."""
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for i, r in enumerate(reqs):
        if r.bias_ids:
            rows += [i] * len(r.bias_ids)
            cols += r.bias_ids
            vals += r.bias_values
    if rows:
        dev = logits.device
        index = (torch.tensor(rows, device=dev), torch.tensor(cols, device=dev))
        logits.index_put_(index, torch.tensor(vals, dtype=logits.dtype, device=dev), accumulate=True)
    return logits


def _filter(logits: torch.Tensor, reqs: Sequence[Req]) -> torch.Tensor:
    """Top-k, then top-p, then min-p, on one descending sort of each row."""
    dev, vocab = logits.device, logits.shape[1]
    top_k = torch.tensor([r.params.top_k if r.params.top_k > 0 else vocab for r in reqs], device=dev)
    top_p = torch.tensor([r.params.top_p for r in reqs], device=dev, dtype=logits.dtype)
    min_p = torch.tensor([r.params.min_p for r in reqs], device=dev, dtype=logits.dtype)
    srt, idx = logits.sort(dim=-1, descending=True)
    drop = torch.arange(vocab, device=dev)[None, :] >= top_k[:, None]
    srt = srt.masked_fill(drop, float("-inf"))
    probs = torch.softmax(srt, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
    drop = drop | (before > top_p[:, None]) | (probs < min_p[:, None] * probs[:, :1])
    srt = srt.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(1, idx, srt)
