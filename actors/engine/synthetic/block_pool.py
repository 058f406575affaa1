"""Free-list block allocator of one synthetic engine (block ids are shared by its ranks)."""

from __future__ import annotations

from actors.kv.transfer_errors import KVTransferError


class OutOfBlocksError(KVTransferError, RuntimeError):
    """Not enough free KV blocks for a request."""


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count < 0:
            raise ValueError(f"cannot allocate {count} blocks")
        if count > len(self._free):
            raise OutOfBlocksError(f"need {count} KV blocks, {len(self._free)} free of {self.num_blocks}")
        ids = [self._free.pop() for _ in range(count)]
        self._used.update(ids)
        return ids

    def free(self, block_ids: list[int]) -> None:
        unknown = [b for b in block_ids if b not in self._used]
        if unknown:
            raise ValueError(f"freeing blocks that are not allocated: {unknown}")
        for block_id in block_ids:
            self._used.remove(block_id)
            self._free.append(block_id)
