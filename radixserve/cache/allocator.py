"""A free list of KV pages. Pure Python: a slot is an int index into the pool's tensors, and
page p holds slots [p * page_size, (p + 1) * page_size)."""

from __future__ import annotations


class SlotAllocator:
    """Hands out whole pages, as their slot indices. Who frees: whoever holds the slots (the
    cache manager for requests, the prefix cache for cached tokens); each page has one owner.
    `free` frees every page its slots touch, so a request's partly used last page goes back
    with it."""

    def __init__(self, size: int, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size: must be at least 1, got {page_size}")
        num_pages = size // page_size
        if num_pages <= 0:
            raise ValueError(f"the KV pool needs at least one page of {page_size} slots, got {size} slots")
        self.page_size = page_size
        self.size = num_pages * page_size
        self._free = list(range(num_pages - 1, -1, -1))  # popped from the end: low indices first
        self._used = bytearray(num_pages)

    @property
    def num_free(self) -> int:
        return len(self._free) * self.page_size

    @property
    def num_used(self) -> int:
        return self.size - self.num_free

    def alloc(self, n: int) -> list[int] | None:
        """Slots of ceil(n / page_size) whole pages, or None (nothing taken) if too few are free."""
        pages = -(-n // self.page_size)
        if pages > len(self._free):
            return None
        if pages == 0:
            return []
        out = self._free[-pages:]
        del self._free[-pages:]
        out.reverse()
        used, ps = self._used, self.page_size
        for p in out:
            used[p] = 1
        if ps == 1:
            return out
        return [p * ps + i for p in out for i in range(ps)]

    def free(self, slots: list[int]) -> None:
        used, ps = self._used, self.page_size
        pages = slots if ps == 1 else list(dict.fromkeys(s // ps for s in slots))
        for p in pages:
            if not used[p]:
                raise RuntimeError(f"page {p} freed twice")
            used[p] = 0
        self._free.extend(reversed(pages))

    def free_pages(self) -> set[int]:
        return set(self._free)
