"""The producer's lease board: registered memory a reader READs to learn whether its lease held.

A reader's data READ is one-sided: nothing tells it whether the producer still held the blocks
while the bytes moved. So every producer rank publishes, in DRAM registered with its NIXL agent,
one 64-bit record per held lease (and, with `transfer.verify` on, a checksum per (block, head)).
Invariant: a record still HELD after the data READ proves the blocks were not given back before it
ended, so vLLM cannot have reused them; RELEASED, or no record within the read timeout, fails the
pull (fail closed). No clock crosses nodes, and the producer's owner thread does nothing on the
reader's path. A record's life cycle and its word: `LeaseBoard`.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

import numpy as np

from actors.kv.transfer_errors import HandshakeError

EMPTY, HELD, RELEASED = 0, 1, 2
MODES = {"off": 0, "sample": 1, "all": 2}
BUCKET = 8  # slots a reader READs at once (64 bytes)
BUCKETS = 1024


def lease_tag(lease_id: str) -> int:
    """60-bit tag of a lease id (never 0)."""
    digest = hashlib.blake2b(lease_id.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 4) | 1


def record(tag: int, mode: int, state: int) -> int:
    return (tag << 4) | (mode << 2) | state


def parse(word: int) -> tuple[int, int, int]:
    """(tag, mode, state) of a record word."""
    return word >> 4, (word >> 2) & 3, word & 3


@dataclass(frozen=True)
class BoardInfo:
    """Where a rank's board lives: part of its handshake payload."""

    records_addr: int
    buckets: int
    bucket: int
    sums_addr: int  # 0 when the rank records no checksums
    heads: int
    num_blocks: int

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: object) -> "BoardInfo":
        try:
            info = cls(**{k: int(data[k]) for k in cls.__dataclass_fields__})  # type: ignore[index]
        except (KeyError, TypeError, ValueError) as exc:
            raise HandshakeError("board", f"malformed: {exc}") from None
        if info.records_addr <= 0 or info.buckets < 1 or info.bucket < 1 or info.heads < 1 \
                or info.num_blocks < 1 or info.sums_addr < 0:
            raise HandshakeError("board", f"bad values {info}")
        return info


class LeaseBoard:
    """One rank's records and checksum table, in one DRAM buffer (registered by the transport).

    No lock: written only by the rank's owner thread; readers' READs see
    whole aligned 8-byte words.

    Life cycle of one lease's record (`LeaseBoard`, owned by the rank's `RankTransfer`):

      1. hold      checksums of the lease's blocks are written first (all, a
                   sample, or none: `mode`), then the record `tag | mode | HELD`
                   in a free slot of the tag's bucket (one aligned 8-byte store);
      2. read      readers READ the whole bucket (`BUCKET` slots) after their
                   data READ, find their tag, and see HELD;
      3. release   the reader notices, an abort or the lease's expiry turn the
                   record into `tag | RELEASED` *before* the blocks are reported
                   free to the engine; a reader seeing it fails at once;
      4. reuse     a later hold may take a RELEASED slot (its readers then find no
                   record and fail when the read timeout passes).

    Record word: bits 0-1 state (0 empty, 1 held, 2 released), bits 2-3 checksum
    mode (0 none, 1 sample, 2 all), bits 4-63 the tag (60 bits of blake2b of the
    lease id: both sides compute it, so no id travels). A full bucket (more than
    `BUCKET` live leases hashing alike) publishes no record: its readers fail
    closed, counted in `full`.
    """

    def __init__(self, num_blocks: int, heads: int, with_sums: bool, buckets: int = BUCKETS):
        self.buckets, self.num_blocks, self.heads = buckets, num_blocks, heads
        sums = num_blocks * heads if with_sums else 0
        self._buf = np.zeros(buckets * BUCKET + sums, dtype=np.uint64)
        self.records = self._buf[: buckets * BUCKET]
        self.sums = self._buf[buckets * BUCKET:].reshape(num_blocks, heads) if with_sums else None
        self._slot: dict[str, int] = {}  # lease id -> slot holding its record
        self.published = self.released = self.full = 0

    def regions(self) -> list[tuple[int, int]]:
        return [(self._buf.ctypes.data, self._buf.nbytes)]

    def info(self) -> BoardInfo:
        sums_addr = self.sums.ctypes.data if self.sums is not None else 0
        return BoardInfo(self.records.ctypes.data, self.buckets, BUCKET, sums_addr, self.heads, self.num_blocks)

    def write_sums(self, block_ids: np.ndarray, sums: np.ndarray) -> None:
        if self.sums is not None and block_ids.size:
            self.sums[block_ids] = sums.astype(np.uint64, copy=False)

    def publish(self, lease_id: str, mode: str) -> bool:
        """Record the lease as HELD (checksums must be written first); False if its bucket is full."""
        if lease_id in self._slot:
            self.release(lease_id)
        tag = lease_tag(lease_id)
        first = (tag % self.buckets) * BUCKET
        words = self.records[first:first + BUCKET]
        states = words & np.uint64(3)
        free = np.flatnonzero((words >> np.uint64(4)) == np.uint64(tag))  # a re-grant: its own slot
        if not free.size:
            free = np.flatnonzero(states == EMPTY)
        if not free.size:
            free = np.flatnonzero(states == RELEASED)
        if not free.size:
            self.full += 1
            return False
        slot = first + int(free[0])
        self.records[slot] = np.uint64(record(tag, MODES[mode], HELD))
        self._slot[lease_id] = slot
        self.published += 1
        return True

    def release(self, lease_id: str) -> None:
        """Mark the lease's record RELEASED (before its blocks go back to the engine)."""
        slot = self._slot.pop(lease_id, None)
        if slot is None:
            return
        tag, mode, _ = parse(int(self.records[slot]))
        self.records[slot] = np.uint64(record(tag, mode, RELEASED))
        self.released += 1

    def counters(self) -> dict:
        return {"published": self.published, "released": self.released, "full": self.full,
                "live": len(self._slot)}


def find(bucket: np.ndarray, tag: int) -> tuple[int, int] | None:
    """(state, mode) of `tag`'s record in a bucket a reader landed, or None."""
    for word in bucket.tolist():
        t, mode, state = parse(int(word))
        if t == tag and state != EMPTY:
            return state, mode
    return None
