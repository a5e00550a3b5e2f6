"""Jump-forward decoding: when the grammar allows exactly one continuation (`"name": "` after
an object opens), append its tokens at once instead of sampling them one forward pass each;
the next step feeds them together with the request's pending token.

The forced text is retokenized together with the last sampled token, so the new tokens are
the ones the tokenizer produces for that text; when the sampled token would merge with the
forced text, the forced text is tokenized on its own (still the same text, just split at the
boundary). The last forced token is not appended: the model samples it, so it can merge with
what follows. Tokens the matcher refuses are rolled back and nothing is forced.
"""

from __future__ import annotations

from typing import Any

from radixserve.request import Req


def forced_tokens(req: Req, tokenizer: Any) -> list[int]:
    """Tokens the grammar forces after req's last token, already accepted by its matcher."""
    m = req.grammar
    if m is None or not req.grammar_active or m.is_terminated() or req.params.return_logprob:  # no logprobs for forced
        return []
    return forced_after(m, req.token_ids[-1], req.remaining_new_tokens, tokenizer)


def forced_after(m: Any, last: int, budget: int, tokenizer: Any) -> list[int]:
    """The same for a matcher whose last accepted token is `last`, with `budget` new tokens left
    (a speculative draft asks this after its own tokens: sched/spec.py)."""
    text = m.jump_forward()
    if not text or budget <= 0:
        return []
    joined = tokenizer.encode(tokenizer.decode([last]) + text, add_special_tokens=False)
    ids = joined[1:] if joined and joined[0] == last else tokenizer.encode(text, add_special_tokens=False)
    # The last forced token is left to the model: the text after it may merge with it into
    # another token (`"` + `:` -> `":`), which the model should choose itself.
    ids = ids[: min(budget - 1, len(ids) - 1)]  # the model samples one more token after them
    for n, t in enumerate(ids):
        if not m.accept(t):
            m.rollback(n)
            return []
    return ids
