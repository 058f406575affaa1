"""Producer-side block leases: who may still read a finished prefill's KV blocks.

A finished prefill's blocks are held under a lease naming how many reader ranks will pull them and
how long they may take; the last distinct reader's notice, expiry or an abort releases it.
Invariants: every path returns the block ids exactly once, so free-block counts return to baseline
whatever happens; notices are idempotent per reader (transports may redeliver); late or unknown
notices are counted, never raised. The clock is injected, so expiry is testable without sleeping.
The life cycle: `LeaseTable`.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from actors.kv.transfer_errors import LeaseError


@dataclass(frozen=True)
class Lease:
    """One request's held blocks (immutable; the table swaps in updated copies)."""

    req_id: str
    block_ids: tuple[int, ...]
    readers_expected: int
    readers_heard: frozenset[str]
    expires_at: float

    @property
    def readers_remaining(self) -> int:
        return self.readers_expected - len(self.readers_heard)


def _check_block_ids(block_ids: Iterable[int]) -> tuple[int, ...]:
    try:
        ids = tuple(block_ids)
    except TypeError:
        raise LeaseError("block_ids must be an iterable of ints") from None
    for block_id in ids:
        if isinstance(block_id, bool) or not isinstance(block_id, int) or block_id < 0:
            raise LeaseError(f"block ids must be ints >= 0, got {block_id!r}")
    # Duplicates are not rejected: with prefix caching two leases (or groups)
    # may legitimately name the same physical block; the engine refcounts.
    return ids


class LeaseTable:
    """Leases of one producer rank, keyed by request id.

    No lock: the table belongs to one rank's `RankTransfer`, which is driven
    from one thread (a vLLM worker's step thread or a rank actor's executor).

    1. Prefill finishes. Its KV blocks are not freed; they are held under a lease
       (`grant`) naming how many reader ranks will pull them (the decode side's
       `dcp_consumer_count` for this rank) and how long they may take (`ttl_s`).
    2. Each decode rank, after its NIXL READ completes, notifies this rank
       (`notify(req_id, reader)`). Notifications are idempotent per reader name,
       because transports may redeliver.
    3. When the last distinct reader has been heard, the lease is released and
       `notify` hands back the block ids for the engine to free.
    4. If readers never show up (decode crashed, request dropped), the periodic
       `expire()` sweep releases the lease once `expires_at` has passed.
    5. An abort (`release`) frees the blocks at once.

    Every path returns the block ids exactly once, so free-block counts return to
    baseline whatever happens. Late or unknown notifications are counted, never
    raised: a decode rank that is slower than the lease is not a producer error.
    The clock is injected (`clock=`) so expiry is testable without sleeping.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        if not callable(clock):
            raise LeaseError("clock must be callable")
        self._clock = clock
        self._leases: dict[str, Lease] = {}
        # (expires_at, seq, req_id) min-heap; entries of leases released
        # another way go stale and are skipped (seq tells re-grants apart).
        self._deadlines: list[tuple[float, int, str]] = []
        self._seq_of: dict[str, int] = {}
        self._next_seq = 0

        self.granted = 0
        self.released_by_readers = 0
        self.expired = 0
        self.aborted = 0
        self.unknown_notifications = 0

    def grant(self, req_id: str, block_ids: Iterable[int], readers: int, ttl_s: float) -> Lease:
        """Hold `block_ids` for `req_id` until `readers` readers notify or `ttl_s` passes."""
        if not isinstance(req_id, str) or not req_id:
            raise LeaseError("req_id must be a non-empty str")
        if isinstance(readers, bool) or not isinstance(readers, int) or readers < 1:
            raise LeaseError(f"readers must be an int >= 1, got {readers!r}")
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) \
                or not math.isfinite(ttl_s) or ttl_s <= 0:
            raise LeaseError(f"ttl_s must be a finite number > 0, got {ttl_s!r}")
        ids = _check_block_ids(block_ids)
        if req_id in self._leases:
            # A second grant would orphan the first lease's blocks.
            raise LeaseError(f"request {req_id!r} already holds a lease")
        lease = Lease(req_id, ids, readers, frozenset(), self._clock() + float(ttl_s))
        self._leases[req_id] = lease
        seq = self._next_seq
        self._next_seq += 1
        self._seq_of[req_id] = seq
        heapq.heappush(self._deadlines, (lease.expires_at, seq, req_id))
        self.granted += 1
        return lease

    def notify(self, req_id: str, reader: str, readers_expected: int | None = None) -> list[int] | None:
        """Record that `reader` is done; return the block ids if it was the last one.

        `readers_expected`, when given, replaces the count set at grant time:
        the readers know how many of them there are (their `dcp_consumer_count`)
        better than the producer, which may not know the decode engine yet.

        Unknown (already released, expired, never granted) ids return None and
        bump `unknown_notifications`. Expiry is enforced only by `expire()`:
        a lease past its deadline but not yet swept still counts its readers.
        """
        if not isinstance(reader, str) or not reader:
            raise LeaseError("reader must be a non-empty str")
        lease = self._leases.get(req_id)
        if lease is None:
            self.unknown_notifications += 1
            return None
        if reader in lease.readers_heard:
            return None  # redelivered notification
        if readers_expected is not None:
            if isinstance(readers_expected, bool) or not isinstance(readers_expected, int) \
                    or readers_expected < 1:
                raise LeaseError(f"readers_expected must be an int >= 1, got {readers_expected!r}")
            lease = dataclasses.replace(lease, readers_expected=readers_expected)
        lease = dataclasses.replace(lease, readers_heard=lease.readers_heard | {reader})
        if lease.readers_remaining > 0:
            self._leases[req_id] = lease
            return None
        self._drop(req_id)
        self.released_by_readers += 1
        return list(lease.block_ids)

    def release(self, req_id: str) -> list[int]:
        """Abort: free the request's blocks now (empty list if it holds none)."""
        lease = self._drop(req_id)
        if lease is None:
            return []
        self.aborted += 1
        return list(lease.block_ids)

    def expire(self) -> list[tuple[str, list[int]]]:
        """Release every lease whose deadline has passed, earliest first."""
        now = self._clock()
        out: list[tuple[str, list[int]]] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, seq, req_id = heapq.heappop(self._deadlines)
            if self._seq_of.get(req_id) != seq:
                continue  # stale entry: that lease already left another way
            lease = self._drop(req_id)
            if lease is not None:
                self.expired += 1
                out.append((req_id, list(lease.block_ids)))
        return out

    def get(self, req_id: str) -> Lease | None:
        return self._leases.get(req_id)

    def held(self) -> int:
        """Number of leases currently held."""
        return len(self._leases)

    def counters(self) -> dict[str, Any]:
        """Plain-dict view for status endpoints and metrics exporters."""
        return {
            "held": len(self._leases),
            "held_blocks": sum(len(lease.block_ids) for lease in self._leases.values()),
            "granted": self.granted,
            "released_by_readers": self.released_by_readers,
            "expired": self.expired,
            "aborted": self.aborted,
            "unknown_notifications": self.unknown_notifications,
        }

    def _drop(self, req_id: str) -> Lease | None:
        lease = self._leases.pop(req_id, None)
        self._seq_of.pop(req_id, None)
        # Stale heap entries are bounded by grants within one TTL, but a burst
        # of early releases under a long TTL could pile them up: compact.
        if len(self._deadlines) > 2 * len(self._leases) + 64:
            self._deadlines = [e for e in self._deadlines if self._seq_of.get(e[2]) == e[1]]
            heapq.heapify(self._deadlines)
        return lease
