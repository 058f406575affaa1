"""Which engine holds which prefix-cache blocks, keyed the way vLLM keys its prefix cache
(`actors.prefix_wire`: the hash scheme, the events and the replication types).

Life cycle of an engine's entries:

  stored    `apply(engine, KVEventsBatch)` with the engine's relayed events (runs of
            stores or removals merged by `coalesce`: one op per run);
  evicted   by the engine (BlocksRemoved / AllBlocksCleared), or here when the
            engine exceeds `max_blocks_per_engine` (oldest first; bounds memory
            even if a removal was lost);
  dropped   `drop_engine` when the engine dies, restarts or is unregistered.

One owner (the coordinator) applies events and logs every change as an
`IndexOp`; routers keep a replica in step with `updates_since(cursor)` (only the
ops after their cursor, or a full snapshot when the log no longer reaches back,
or the owner restarted). Pure Python: no Ray, no vLLM.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

from actors.prefix_wire import (
    BlocksRemoved,
    BlocksStored,
    HashScheme,
    IndexCursor,
    IndexOp,
    IndexUpdate,
    KVEventsBatch,
    PackedOps,
)


class _EngineBlocks:
    __slots__ = ("scheme", "blocks")

    def __init__(self, scheme: HashScheme):
        self.scheme = scheme
        self.blocks: OrderedDict[int, None] = OrderedDict()  # oldest store first


class PrefixIndex:
    def __init__(self, max_blocks_per_engine: int | None = 100_000, max_log_hashes: int = 200_000):
        """`max_blocks_per_engine`: the owner's cap (None for a replica: it mirrors the owner's
        evictions); `max_log_hashes`: how much change history replicas may catch up from."""
        self.max_blocks_per_engine = max_blocks_per_engine
        self.max_log_hashes = max_log_hashes
        self.epoch = uuid.uuid4().hex
        self.seq = 0
        self._engines: dict[str, _EngineBlocks] = {}
        self._log: deque[tuple[int, IndexOp]] = deque()
        self._log_hashes = 0
        self._log_start = 0  # ops with seq > _log_start are in the log
        self.evicted = 0  # blocks dropped by the per-engine cap

    # -------------------------------------------------------------- owner
    def apply(self, engine_id: str, batch: KVEventsBatch) -> None:
        """An engine's relayed events, in order."""
        if batch.reset:
            self._op(IndexOp(engine_id, "clear"))
        for ev in batch.events:
            if isinstance(ev, BlocksStored):
                if ev.hashes:
                    self._op(IndexOp(engine_id, "store", ev.hashes, batch.scheme))
            elif isinstance(ev, BlocksRemoved):
                if ev.hashes and engine_id in self._engines:
                    self._op(IndexOp(engine_id, "remove", ev.hashes))
            elif engine_id in self._engines:
                self._op(IndexOp(engine_id, "clear"))

    def drop_engine(self, engine_id: str) -> None:
        if engine_id in self._engines:
            self._op(IndexOp(engine_id, "clear"))

    def updates_since(self, cursor: IndexCursor | None) -> IndexUpdate:
        now = IndexCursor(self.epoch, self.seq)
        if cursor is not None and cursor.epoch == self.epoch and cursor.seq >= self._log_start:
            ops = [op for seq, op in self._log if seq > cursor.seq]
            return IndexUpdate(now, PackedOps.of(ops), full=False)
        snapshot = [IndexOp(eid, "store", tuple(e.blocks), e.scheme) for eid, e in self._engines.items()]
        return IndexUpdate(now, PackedOps.of(snapshot), full=True)

    # ------------------------------------------------------------ replica
    def apply_update(self, update: IndexUpdate) -> None:
        if update.full:
            self._engines.clear()
        for op in update.ops:
            self._apply_op(op)
        self.epoch, self.seq = update.cursor.epoch, update.cursor.seq

    @property
    def cursor(self) -> IndexCursor:
        return IndexCursor(self.epoch, self.seq)

    # -------------------------------------------------------------- query
    def engines(self) -> dict[str, int]:
        return {eid: len(e.blocks) for eid, e in self._engines.items()}

    def cached_prefix_tokens(self, token_ids: Sequence[int], engine_ids: Iterable[str] | None = None
                             ) -> dict[str, int]:
        """Per engine: prompt tokens at the start of `token_ids` whose blocks it holds.

        As vLLM, at most `len(token_ids) - 1`: the last prompt token is always computed.
        """
        wanted = list(self._engines) if engine_ids is None else [e for e in engine_ids if e in self._engines]
        hashes_by_scheme: dict[HashScheme, list[int]] = {}
        out: dict[str, int] = {}
        for eid in wanted:
            entry = self._engines[eid]
            keys = hashes_by_scheme.get(entry.scheme)
            if keys is None:
                keys = hashes_by_scheme[entry.scheme] = entry.scheme.block_hashes(token_ids)
            n = 0
            for k in keys:
                if k not in entry.blocks:
                    break
                n += 1
            out[eid] = min(n * entry.scheme.block_size, max(0, len(token_ids) - 1))
        return out

    # ----------------------------------------------------------- internal
    def _op(self, op: IndexOp) -> None:
        evicted = self._apply_op(op)
        self._log_op(op)
        if evicted:
            self.evicted += len(evicted)
            self._log_op(IndexOp(op.engine_id, "remove", evicted))

    def _apply_op(self, op: IndexOp) -> tuple[int, ...]:
        """Apply one op; returns the blocks the cap evicted (owner only)."""
        if op.kind == "clear":
            self._engines.pop(op.engine_id, None)
            return ()
        entry = self._engines.get(op.engine_id)
        if op.kind == "remove":
            if entry is not None:
                for h in op.hashes:
                    entry.blocks.pop(h, None)
            return ()
        if entry is None or entry.scheme != op.scheme:
            entry = self._engines[op.engine_id] = _EngineBlocks(op.scheme)  # a new scheme: start over
        for h in op.hashes:
            entry.blocks[h] = None
            entry.blocks.move_to_end(h)
        cap = self.max_blocks_per_engine
        if cap is None or len(entry.blocks) <= cap:
            return ()
        evicted = []
        while len(entry.blocks) > cap:
            evicted.append(entry.blocks.popitem(last=False)[0])
        return tuple(evicted)

    def _log_op(self, op: IndexOp) -> None:
        self.seq += 1
        self._log.append((self.seq, op))
        self._log_hashes += max(1, len(op.hashes))
        while self._log_hashes > self.max_log_hashes and self._log:
            seq, old = self._log.popleft()
            self._log_hashes -= max(1, len(old.hashes))
            self._log_start = seq
