"""A free-list allocator of integer ids: cache pages (blocks) and high-precision sequence slots."""

from __future__ import annotations

from typing import Iterable


class OutOfBlocksError(RuntimeError):
    """More ids were requested than are free."""


class BlockAllocator:
    """Hands out ids in [0, num_blocks); an id is never given out twice before it is freed.

    `what` names the resource in error messages (e.g. "KV-cache pages" or "sequence slots").
    """

    def __init__(self, num_blocks: int, what: str = "KV-cache pages"):
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.what = what
        # Pop from the end: low ids are handed out first, and recently freed ids are reused first.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n distinct free ids; OutOfBlocksError (nothing allocated) if fewer than n are free."""
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"n must be a non-negative int, got {n!r}")
        if n > len(self._free):
            raise OutOfBlocksError(f"out of {self.what}: {n} requested, {len(self._free)} of {self.num_blocks} "
                                   f"free; create the pool with more (num_blocks / max_seqs) or wait for "
                                   f"sequences to finish")
        ids = [self._free.pop() for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: Iterable[int]) -> None:
        """Return ids to the free list; ValueError (nothing freed) for an id that is not allocated."""
        ids = list(ids)
        seen = set()
        for i in ids:
            if i not in self._used or i in seen:
                raise ValueError(f"cannot free {self.what[:-1] if self.what.endswith('s') else self.what} id {i!r}: "
                                 "it is not allocated (double free or foreign id)")
            seen.add(i)
        for i in ids:
            self._used.remove(i)
            self._free.append(i)
