"""Reader side of the lease confirmation: after the data READ, READ the lease's record (and checksums).

Invariants: a pull is confirmed only when every source's record read HELD after its data READ
completed (the blocks were never reused while it ran); RELEASED anywhere expires it; no record yet
is READ again a moment later, until the read timeout; with `transfer.verify` on, the checksums are
recomputed from what landed and any difference fails the pull. Notices go out only after that, so
no producer releases a lease before its readers read the record. In-flight pulls never share
landing memory, and every id and range is checked as for the data READ. The life cycle of one
pull's confirmation: `Confirmer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from actors.kv.plan.descriptors import DescTable, UnitCut
from actors.kv.transfer_errors import BlockRangeError, HandshakeError
from actors.kv.lease.integrity import reader_sums, sampled
from actors.kv.lease.lease_board import HELD, RELEASED, BoardInfo, find
from actors.kv.plan.pull_plan import PeerKey, SourceRead
from actors.kv.transport import TransportBase

HELD_OK, EXPIRED, MISSING = "held", "expired", "missing"


def _rows(addr: int, count: int, nbytes: int) -> DescTable:
    """`count` descriptors of `nbytes`, back to back from `addr`."""
    return DescTable((addr,), count, nbytes, UnitCut(1, nbytes, ((0, nbytes),)))


class Landing:
    """Registered DRAM where confirmations land: a bucket per local block, checksums per local unit."""

    def __init__(self, transport: TransportBase, num_blocks: int, bucket: int, ratio: int, heads: int, with_sums: bool):
        self.buckets = np.zeros((num_blocks, bucket), dtype=np.uint64)
        self.sums = np.zeros((num_blocks * ratio if with_sums else 0, heads), dtype=np.uint64)
        self.sums_list = None
        transport.register_extra([(self.buckets.ctypes.data, self.buckets.nbytes)])
        self.bucket_list = transport.local_list(_rows(self.buckets.ctypes.data, num_blocks, bucket * 8), "DRAM")
        if with_sums:
            transport.register_extra([(self.sums.ctypes.data, self.sums.nbytes)])
            self.sums_list = transport.local_list(_rows(self.sums.ctypes.data, num_blocks * ratio, heads * 8),
                                                  "DRAM")


@dataclass(frozen=True)
class SourceConfirm:
    """How one source rank's lease record and checksums are read, prepared at handshake."""

    key: PeerKey
    board: BoardInfo
    records: Any  # the peer's buckets, prepared
    sums: Any | None  # the peer's checksum entries, prepared (None: it records none)
    landing: Landing
    ratio: int
    # what this rank holds of the source, to recompute its checksums (None: token shards or a
    # partial layer range, which the producer's per-block checksums do not describe)
    layers: tuple[int, ...] | None
    local_heads: tuple[int, int]
    remote_cols: tuple[int, int]  # the producer's own head indices read (its checksum columns)
    remote_heads: list[int]  # the same as global heads, in the order they land


class Confirmer:
    """Landing memory and per-source lists of one reader rank; posts and reads confirmations.

    Life cycle of one pull's confirmation on a decode rank (`RankTransfer.step`):

      1. the data READs of every source completed (no notice rides on them);
      2. `post`: per source one READ of the bucket holding the lease's record in
         the producer's board (`actors.kv.lease.lease_board`), landing in this rank's
         `Landing` row of the pull's first local block, plus, with
         `transfer.verify` on, one READ of the checksum entries of the blocks
         this rank checks (landing at their local positions): in-flight pulls
         never share a local block, so they never share landing memory;
      3. `outcome`: HELD in every source -> confirmed (the blocks were still
         leased after the data READ finished, so they were never reused while
         it ran); RELEASED in any -> expired (failed pull); no record -> the
         producer has not leased it yet (a very fast reader) or the record was
         reused: READ it again a moment later, until the read timeout;
      4. `mismatches`: recompute the checksums from what landed (after the
         layout permute) and compare; any difference fails the pull.

    Only then are notices sent (so no producer releases a lease before its
    readers read the record) and the pull reported done. Every id and range is
    checked as for the data READ: landing rows come from checked local ids and
    the remote lists are proven inside the peer's board when prepared.
    """

    def __init__(self, transport: TransportBase, num_blocks: int, verify: str, with_sums: bool):
        self.transport, self.num_blocks, self.verify = transport, num_blocks, verify
        self.with_sums = with_sums  # landing rows for checksums (a rank built with verify on)
        self._landings: dict[tuple[int, int, int, int], Landing] = {}

    def prepare(self, position: int, src: SourceRead, board: BoardInfo | None, layers: tuple[int, ...] | None,
                local_heads: tuple[int, int], remote_cols: tuple[int, int], remote_head0: int) -> SourceConfirm:
        if board is None:
            raise HandshakeError("board", f"{src.key} publishes no lease board: its leases cannot be confirmed")
        ratio = src.local_units if src.token_shard is None else 1
        shape = (position, board.bucket, ratio, board.heads)
        landing = self._landings.get(shape)
        if landing is None:
            landing = self._landings[shape] = Landing(self.transport, self.num_blocks, board.bucket, ratio,
                                                      board.heads, with_sums=self.with_sums)
        records = self.transport.remote_list(src.key, _rows(board.records_addr, board.buckets, board.bucket * 8),
                                             "DRAM")
        sums = None
        if board.sums_addr:
            sums = self.transport.remote_list(src.key, _rows(board.sums_addr, board.num_blocks, board.heads * 8),
                                              "DRAM")
        if remote_cols[1] > board.heads:
            raise HandshakeError("board", f"{src.key} records {board.heads} heads, the read needs {remote_cols}")
        return SourceConfirm(src.key, board, records, sums, landing, ratio,
                             layers if src.token_shard is None else None, local_heads, remote_cols,
                             [remote_head0 + h for h in range(*remote_cols)])

    def _checked(self, tag: int, remote_ids: np.ndarray, mode: str) -> np.ndarray:
        """Positions (in the request's remote ids) whose checksums `mode` checks."""
        if mode == "off" or remote_ids.size == 0:
            return np.zeros(0, dtype=np.int64)
        if mode == "all":
            return np.arange(remote_ids.size)
        return np.flatnonzero(sampled(tag, remote_ids))

    def post(self, req_id: str, sources: list[SourceConfirm], tag: int, local_ids: np.ndarray,
             remote_ids: np.ndarray) -> None:
        """READ every source's record bucket (and the checksums this rank checks)."""
        if local_ids.size == 0:
            raise BlockRangeError("a pull without local blocks has nothing to confirm into")
        items = self._checked(tag, remote_ids, self.verify)
        for sc in sources:
            bucket = np.array([tag % sc.board.buckets], dtype=np.int64)
            self.transport.start_read(req_id, sc.key, sc.landing.bucket_list, local_ids[:1], sc.records, bucket,
                                      b"", sc.board.bucket * 8)
            if sc.sums is None or sc.landing.sums_list is None or sc.layers is None or not items.size:
                continue
            if int(remote_ids.max()) >= sc.board.num_blocks:
                raise BlockRangeError(f"remote block {int(remote_ids.max())} outside {sc.key}'s board")
            local_pos = local_ids[items // sc.ratio] * sc.ratio + items % sc.ratio
            self.transport.start_read(req_id, sc.key, sc.landing.sums_list, local_pos, sc.sums, remote_ids[items],
                                      b"", int(items.size) * sc.board.heads * 8)

    @staticmethod
    def outcome(sources: list[SourceConfirm], tag: int, first_local: int) -> tuple[str, dict[PeerKey, int]]:
        """(held | expired | missing, the checksum mode each source recorded)."""
        modes: dict[PeerKey, int] = {}
        missing = False
        for sc in sources:
            found = find(sc.landing.buckets[first_local], tag)
            if found is None:
                missing = True
                continue
            state, mode = found
            if state == RELEASED:
                return EXPIRED, modes
            if state == HELD:
                modes[sc.key] = mode
        return (MISSING if missing else HELD_OK), modes

    def mismatches(self, sources: list[SourceConfirm], modes: dict[PeerKey, int], tag: int, planes: list,
                   layout: Any, first_layer: int, local_ids: np.ndarray, remote_ids: np.ndarray
                   ) -> tuple[list[str], int, int]:
        """(differences, blocks checked, sources that could not be checked) of a confirmed pull."""
        items = self._checked(tag, remote_ids, self.verify)
        bad: list[str] = []
        checked = unverifiable = 0
        for sc in sources:
            mode = modes.get(sc.key, 0)
            if not items.size or mode == 0 or sc.sums is None or sc.landing.sums_list is None or sc.layers is None:
                unverifiable += int(bool(items.size))
                continue
            mine = items if mode == 2 else items[sampled(tag, remote_ids[items])]
            if not mine.size:
                continue
            local_pos = local_ids[mine // sc.ratio] * sc.ratio + mine % sc.ratio
            want = sc.landing.sums[local_pos, sc.remote_cols[0]:sc.remote_cols[1]]
            got = reader_sums(planes, layout, first_layer, sc.layers, local_ids[mine // sc.ratio],
                              mine % sc.ratio, sc.ratio, sc.local_heads, sc.remote_heads)
            diff = np.flatnonzero((want != got).any(axis=1))
            checked += int(mine.size)
            bad += [f"remote block {int(remote_ids[mine[i]])} of {sc.key}: checksum differs" for i in diff[:4]]
        return bad, checked, unverifiable

