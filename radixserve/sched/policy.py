"""Ordering of the waiting queue and the up-front admission checks."""

from __future__ import annotations

from collections.abc import Callable

from radixserve.request import InvalidParam, Req

POLICIES = ("fcfs", "lpm")


def keep_key(req: Req) -> tuple[int, float]:
    """Most important first: higher priority, then older. Retraction takes from the end."""
    return (-req.priority, req.arrival)


class Policy:
    """fcfs: priority, then arrival. lpm: priority, then longest cached prefix, then arrival;
    matching costs O(queue) tree walks, so above `lpm_queue_cap` waiting requests it falls
    back to fcfs."""

    def __init__(self, name: str = "fcfs", lpm_queue_cap: int = 128) -> None:
        if name not in POLICIES:
            raise ValueError(f"schedule_policy: {name!r} is not supported; choose from: {', '.join(POLICIES)}")
        self.name = name
        self.lpm_queue_cap = lpm_queue_cap

    def order(self, waiting: list[Req], cached_len: Callable[[Req], int]) -> list[Req]:
        if self.name == "lpm" and 1 < len(waiting) <= self.lpm_queue_cap:
            hits = {r.rid: cached_len(r) for r in waiting}
            return sorted(waiting, key=lambda r: (-r.priority, -hits[r.rid], r.arrival))
        return sorted(waiting, key=keep_key)


def check_admissible(req: Req, context_len: int, pool_slots: int) -> None:
    """Refuse up front what could never run (raises ValueError naming the parameter)."""
    total = req.prompt_len + req.max_new_tokens
    if req.prompt_len == 0:
        raise InvalidParam("prompt", "the prompt is empty")
    if req.prompt_len > context_len:
        raise InvalidParam("prompt", f"{req.prompt_len} tokens exceed the context window of {context_len}")
    if total > context_len:
        raise InvalidParam("max_new_tokens", f"prompt ({req.prompt_len} tokens) + max_new_tokens ({req.max_new_tokens}) = "
                                             f"{total} exceeds the context window of {context_len}")
    if total > pool_slots:
        raise InvalidParam("max_new_tokens", f"prompt + max_new_tokens = {total} tokens exceeds the whole KV pool "
                                             f"({pool_slots} slots); raise kv_cache_tokens or lower max_new_tokens")
