"""A prefill rank's side of a transfer: leases, their board records and checksums, readers' notices.

`LeaseKeeper`, driven by `RankTransfer`, holds a request's blocks under a lease, publishes its
record (and, with `transfer.verify`, checksums) on the lease board, and releases it on the last
reader's notice, an ok=false notice, expiry or the engine's own release. Invariant: whichever way a
lease ends, its record turns RELEASED *before* its blocks are reported free, so a reader that READs
the record after that fails its pull instead of using blocks the engine may reuse. The owner does
nothing for a read (NIXL's progress thread serves it). The life cycle: `LeaseKeeper`.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

import torch

from actors.kv.plan.descriptors import checked_block_ids
from actors.kv.faults import NO_FAULTS, FaultPolicy
from actors.kv.lease.integrity import producer_sums, sampled
from actors.kv.plan.layout import CacheGeometry
from actors.kv.lease.lease import LeaseTable
from actors.kv.lease.lease_board import LeaseBoard, lease_tag
from actors.kv.lease.notify import ReaderNotice, decode_notice
from actors.kv.transport import TransportBase

logger = logging.getLogger("raypd.transfer")


class LeaseKeeper:
    """Leases of one rank with their board records; no lock (the rank's owner thread only).

      1. hold      the request's blocks go under a lease (`LeaseTable`); with
                   `transfer.verify` on, their checksums (all, or the sample both
                   sides agree on) are written to the lease board, then the lease's
                   record is published HELD (`actors.kv.lease.lease_board`); notices that
                   came before the lease (a reader that gave up early) apply now;
      2. read      readers READ the blocks, then the record (and checksums); the
                   owner does nothing for it (NIXL's progress thread serves them);
      3. notices   each reader's notice, sent once it saw HELD, counts; the last
                   one releases the lease; an ok=false notice (a reader gave up)
                   releases it at once;
      4. expiry    a lease no reader finished within its TTL is released;
      5. release   the engine frees a lease itself (abort, nobody will read).

    Whichever way a lease ends, its record turns RELEASED *before* its blocks are
    reported free (by `step()` or `release()`), so a reader that READs the record
    after that fails its pull instead of using blocks the engine may reuse.
    """

    def __init__(self, geometry: CacheGeometry, planes: list[list[torch.Tensor]], head0: int, verify: str,
                 board: LeaseBoard | None, faults: FaultPolicy = NO_FAULTS,
                 clock: Callable[[], float] = time.monotonic, early_notice_ttl_s: float = 60.0):
        self.geometry, self.planes, self.head0 = geometry, planes, head0
        self.verify = verify
        self.board = board
        self.faults = faults
        self.leases = LeaseTable(clock=clock)
        self._clock = clock
        self._early: dict[str, tuple[float, list[ReaderNotice]]] = {}
        self._released: list[str] = []  # freed outside step(), reported by the next step()
        self.early_notice_ttl_s = early_notice_ttl_s
        self.sums_s = 0.0  # time spent computing checksums at hold (benchmarks read it)

    @property
    def busy(self) -> bool:
        return bool(self.leases.held() or self._early or self._released)

    @property
    def wants_notices(self) -> bool:
        return bool(self.leases.held() or self._early)

    def hold(self, req_id: str, block_ids: Sequence[int], ttl_s: float) -> None:
        self.leases.grant(req_id, block_ids, readers=1, ttl_s=ttl_s)
        if self.board is not None:
            mode = self.verify if self.board.sums is not None else "off"
            if mode != "off":
                t0 = time.perf_counter()
                ids = checked_block_ids("held", list(block_ids), self.geometry.num_blocks)
                if mode == "sample":
                    ids = ids[sampled(lease_tag(req_id), ids)]
                self.board.write_sums(ids, producer_sums(self.planes, self.geometry.layout,
                                                         self.geometry.first_layer, self.head0, ids))
                self.sums_s += time.perf_counter() - t0
            if not self.board.publish(req_id, mode):
                logger.warning("lease board bucket of %s is full: its readers will fail closed", req_id)
        if self.faults.corrupts(req_id) and len(block_ids):
            self._corrupt(int(block_ids[0]))
        for notice in self._early.pop(req_id, (0.0, []))[1]:
            if self._apply(notice) is not None:
                self._released.append(req_id)

    def _corrupt(self, block: int) -> None:
        """Fault injection: flip one byte of `block` after its checksums were recorded."""
        plane = self.planes[0][0]
        raw = plane[block].view(torch.uint8).view(-1)
        raw[0] ^= 0x5A
        logger.warning("fault injection: flipped a byte of block %d", block)

    def _end(self, req_id: str, blocks: list[int] | None) -> list[int] | None:
        """A lease left the table: its record turns RELEASED before anyone hears of the blocks."""
        if blocks is not None and self.board is not None:
            self.board.release(req_id)
        return blocks

    def release(self, req_id: str) -> list[int]:
        self._early.pop(req_id, None)
        blocks = self._end(req_id, self.leases.release(req_id) or None) or []
        if blocks:
            self._released.append(req_id)
        return blocks

    def _apply(self, notice: ReaderNotice) -> list[int] | None:
        if not notice.ok:
            return self._end(notice.req_id, self.leases.release(notice.req_id) or None)
        return self._end(notice.req_id, self.leases.notify(notice.req_id, notice.reader, notice.readers_expected))

    def step(self, notices: list[bytes]) -> tuple[list[str], list[str]]:
        """(released, expired) lease ids: notices applied, then expiry."""
        released, self._released = self._released, []
        if not (self.leases.held() or self._early or notices):
            return released, []
        for msg in notices:
            notice = decode_notice(msg)
            if notice is None:
                continue
            if self.leases.get(notice.req_id) is None:
                # A notice faster than our lease grant: keep it for a while.
                self._early.setdefault(notice.req_id, (self._clock(), []))[1].append(notice)
                continue
            if self._apply(notice) is not None:
                released.append(notice.req_id)
        now = self._clock()
        for req_id in [r for r, (t, _) in self._early.items() if now - t > self.early_notice_ttl_s]:
            del self._early[req_id]
        expired = [req_id for req_id, blocks in self.leases.expire() if self._end(req_id, blocks) is not None]
        return released, expired

    def counters(self) -> dict:
        out = self.leases.counters()
        if self.board is not None:
            out["board"] = self.board.counters()
        return out


def new_board(geometry: CacheGeometry, role: str, verify: str, transport: TransportBase) -> LeaseBoard | None:
    """The rank's lease board, registered with its transport (none for a decode-only rank)."""
    if role == "decode":
        return None
    heads = geometry.num_heads
    board = LeaseBoard(geometry.num_blocks, heads, with_sums=verify != "off")
    transport.register_extra(board.regions())
    return board
