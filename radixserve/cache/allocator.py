"""A free list of KV slots. Pure Python: a slot is an int index into the pool's tensors."""

from __future__ import annotations


class SlotAllocator:
    """Hands out slot indices in [0, size). Who frees: whoever holds the slots (the cache
    manager for requests, the prefix cache for cached tokens); each slot has one owner."""

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ValueError(f"the KV pool needs at least one slot, got {size}")
        self.size = size
        self._free = list(range(size - 1, -1, -1))  # popped from the end: low indices first
        self._used = bytearray(size)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.size - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """n slots, or None (and nothing taken) when fewer than n are free."""
        if n > len(self._free):
            return None
        if n == 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        out.reverse()
        used = self._used
        for s in out:
            used[s] = 1
        return out

    def free(self, slots: list[int]) -> None:
        used = self._used
        for s in slots:
            if not used[s]:
                raise RuntimeError(f"slot {s} freed twice")
            used[s] = 0
        self._free.extend(reversed(slots))
