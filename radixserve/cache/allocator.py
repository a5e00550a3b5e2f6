"""A free list of KV pages. Pure Python: a slot is an int index into the pool's tensors, and
page p holds slots [p * page_size, (p + 1) * page_size)."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple


class WindowTables(NamedTuple):
    """How the sliding-window layers' own pool is indexed (WindowedAllocator): `slots` maps full
    slots to its rows; a query sees `reach` positions before its own."""

    slots: Callable[[list[int]], list[int]]
    reach: int


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

    def short(self, n: int) -> tuple[int, int]:
        """Slots missing from the free list for an allocation of n (and from a window pool: none here)."""
        return max(-(-n // self.page_size) * self.page_size - self.num_free, 0), 0


class WindowedAllocator(SlotAllocator):
    """Pages for a model with sliding-window layers (Gemma 3, Mistral), in two pools: full pages
    (slots as everywhere: what the requests' tables, the prefix cache and the full-attention
    layers index) and window pages, for the sliding-window layers only. Each full page in use
    holds one window page until its window KV is dropped (`drop_window`: every query that could
    see it has passed its window); from then on the page keeps the full layers' KV alone.

    `alloc` takes both (None, and nothing taken, if either pool is short: `short` tells which);
    `free` gives back a page's window page with it; `window_slots` translates full slots into
    the window pool's, for the sliding-window layers' tables."""

    def __init__(self, size: int, window_size: int, page_size: int = 1) -> None:
        super().__init__(size, page_size)
        self.window = SlotAllocator(window_size, page_size)
        self._win = [-1] * (self.size // page_size)  # full page -> its window page, or -1

    @property
    def num_window_free(self) -> int:
        return self.window.num_free

    def short(self, n: int) -> tuple[int, int]:
        """Slots missing from the (full, window) free lists for an allocation of n."""
        return super().short(n)[0], self.window.short(n)[0]

    def alloc(self, n: int) -> list[int] | None:
        if any(self.short(n)):
            return None
        slots = super().alloc(n)
        wins = self.window.alloc(n)
        assert slots is not None and wins is not None
        ps = self.page_size
        for i in range(0, len(slots), ps):
            self._win[slots[i] // ps] = wins[i] // ps
        return slots

    def free(self, slots: list[int]) -> None:
        self.drop_window(slots)
        super().free(slots)

    def drop_window(self, slots: list[int]) -> None:
        """Give back the window pages of the pages these slots touch (those that still hold one)."""
        ps, win = self.page_size, self._win
        dropped = []
        for p in dict.fromkeys(s // ps for s in slots):
            if win[p] >= 0:
                dropped.append(win[p] * ps)
                win[p] = -1
        if dropped:
            self.window.free(dropped)

    def move_window(self, src: list[int], dst: list[int]) -> None:
        """Hand the window pages of src's pages to dst's, which hold none (a cached tombstone
        takes over a request's window KV of the same tokens; src keeps its full KV)."""
        ps, win = self.page_size, self._win
        for i in range(0, len(src), ps):
            a, b = src[i] // ps, dst[i] // ps
            if win[a] < 0 or win[b] >= 0:
                raise RuntimeError(f"move_window: page {a} has no window page, or page {b} has one")
            win[b], win[a] = win[a], -1

    def has_window(self, slot: int) -> bool:
        return self._win[slot // self.page_size] >= 0

    def window_slots(self, slots: list[int]) -> list[int]:
        """The window pool's slots for these full slots; raises if one's window KV was dropped
        (a sliding-window layer would read rows that are not there)."""
        ps, win = self.page_size, self._win
        try:
            if ps == 1:
                out = [win[s] for s in slots]
            else:
                out = [win[s // ps] * ps + s % ps for s in slots]
        except IndexError:
            raise RuntimeError("window slots: a slot out of the pool") from None
        if out and min(out) < 0:
            raise RuntimeError("window slots: a slot's window KV was dropped while a query could still see it")
        return out

    def window_pages(self) -> dict[int, int]:
        """Full page -> window page, for every page that holds one (integrity checks)."""
        return {p: w for p, w in enumerate(self._win) if w >= 0}
