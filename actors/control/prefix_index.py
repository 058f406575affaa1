"""Which engine holds which prefix-cache blocks, keyed the way vLLM keys its prefix cache.

vLLM (0.32) names a full KV block by a hash chained over the prompt's token ids:
`hash(parent_hash, tuple(block_token_ids), extra_keys)`, the first block's parent
being `NONE_HASH = hash(seed)`; the default algorithm is `sha256` over the
pickled tuple and the seed is "vllm-none-hash" (or PYTHONHASHSEED). Its KV
cache events (`BlockStored` / `BlockRemoved` / `AllBlocksCleared`) report the
same hashes, by default as the low 64 bits (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`).
`HashScheme.block_hashes` computes them here, so a router can ask "how many
leading blocks of this prompt does each engine hold" without asking the engines.

Life cycle of an engine's entries:

  stored    `apply(engine, KVEventsBatch)` with the engine's relayed events (runs of
            stores or removals merged by `coalesce`: one op per run);
  evicted   by the engine (BlockRemoved / AllBlocksCleared), or here when the
            engine exceeds `max_blocks_per_engine` (oldest first; bounds memory
            even if a removal was lost);
  dropped   `drop_engine` when the engine dies, restarts or is unregistered.

One owner (the coordinator) applies events and logs every change as an
`IndexOp`; routers keep a replica in step with `updates_since(cursor)` (only the
ops after their cursor, or a full snapshot when the log no longer reaches back,
or the owner restarted). Pure Python: no Ray, no vLLM.
"""

from __future__ import annotations

import hashlib
import itertools
import pickle
import uuid
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Literal, NamedTuple, Union

DEFAULT_SEED = "vllm-none-hash"  # vLLM's NONE_HASH seed for cryptographic hashes (no PYTHONHASHSEED)
SUPPORTED_ALGOS = ("sha256", "sha256_cbor")  # xxhash uses a random per-process seed: not reproducible
_INT64 = (1 << 64) - 1


class HashSchemeError(ValueError):
    """An engine's prefix-cache hashes cannot be reproduced here (algorithm, block size)."""


def external_key(block_hash: bytes | int) -> int:
    """A block hash as an index key: vLLM's int form (low 64 bits of the digest)."""
    if isinstance(block_hash, int):
        return block_hash & _INT64
    return int.from_bytes(block_hash, "big") & _INT64


@dataclass(frozen=True)
class HashScheme:
    """How one engine hashes its blocks: block size, hash algorithm, NONE_HASH seed."""

    block_size: int
    algo: str = "sha256"
    seed: str = DEFAULT_SEED

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise HashSchemeError(f"block_size must be >= 1, got {self.block_size}")
        if self.algo not in SUPPORTED_ALGOS:
            raise HashSchemeError(
                f"prefix_caching_hash_algo {self.algo!r} cannot be reproduced by the router "
                f"(supported: {', '.join(SUPPORTED_ALGOS)})")

    def _digest(self, obj: object) -> bytes:
        if self.algo == "sha256":
            return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()
        import cbor2

        return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()

    @cached_property
    def none_hash(self) -> bytes:
        return self._digest(self.seed)

    def block_hashes(self, token_ids: Sequence[int], max_blocks: int | None = None) -> list[int]:
        """Index keys of the full blocks of `token_ids`, first block first."""
        keys = self.iter_block_hashes(token_ids)
        return list(keys if max_blocks is None else itertools.islice(keys, max_blocks))

    def iter_block_hashes(self, token_ids: Sequence[int]) -> Iterator[int]:
        """`block_hashes`, one block at a time (a lookup stops hashing at the first block nobody holds)."""
        parent = self.none_hash
        for i in range(len(token_ids) // self.block_size):
            block = tuple(map(int, token_ids[i * self.block_size:(i + 1) * self.block_size]))
            parent = self._digest((parent, block, None))
            yield external_key(parent)


# ---------------------------------------------------------------- events
@dataclass(frozen=True)
class BlocksStored:
    hashes: tuple[int, ...]


@dataclass(frozen=True)
class BlocksRemoved:
    hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = Union[BlocksStored, BlocksRemoved, AllBlocksCleared]


@dataclass(frozen=True)
class KVEventsBatch:
    """An engine's KV cache events, in the order the engine emitted them.

    `reset`: the relay lost events (a gap, or a batch it could not deliver), so
    the owner clears the engine's entries first: under-claiming only costs a
    cache miss, over-claiming would route to blocks that are gone.
    `engine_events`: how many of the engine's own events the batch carries when
    `coalesce` merged runs of them (0: one per entry of `events`).
    """

    scheme: HashScheme
    events: tuple[KVEvent, ...]
    reset: bool = False
    engine_events: int = 0

    @property
    def num_engine_events(self) -> int:
        return self.engine_events or len(self.events)


def coalesce(events: Sequence[KVEvent]) -> tuple[KVEvent, ...]:
    """The same changes in the same order, consecutive stores (and consecutive removals) merged into one
    event: vLLM reports every evicted block as its own BlockRemoved, this ships and applies a run at once."""
    runs: list[tuple[type, list[int]]] = []
    for ev in events:
        if isinstance(ev, AllBlocksCleared):
            runs.append((AllBlocksCleared, []))
        elif runs and runs[-1][0] is type(ev):
            runs[-1][1].extend(ev.hashes)
        else:
            runs.append((type(ev), list(ev.hashes)))
    return tuple(AllBlocksCleared() if kind is AllBlocksCleared else kind(tuple(hashes))
                 for kind, hashes in runs if hashes or kind is AllBlocksCleared)


# ------------------------------------------------------------ replication
class IndexOp(NamedTuple):
    """One change of the index (a NamedTuple: replicas unpickle thousands per refresh)."""

    engine_id: str
    kind: Literal["store", "remove", "clear"]
    hashes: tuple[int, ...] = ()
    scheme: HashScheme | None = None  # store: the engine's scheme


@dataclass(frozen=True)
class IndexCursor:
    epoch: str
    seq: int


@dataclass(frozen=True)
class IndexUpdate:
    """Ops that bring a replica from its cursor to `cursor`; `full`: clear it first."""

    cursor: IndexCursor
    ops: tuple[IndexOp, ...]
    full: bool


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
            ops = tuple(op for seq, op in self._log if seq > cursor.seq)
            return IndexUpdate(now, ops, full=False)
        snapshot = tuple(IndexOp(eid, "store", tuple(e.blocks), e.scheme) for eid, e in self._engines.items())
        return IndexUpdate(now, snapshot, full=True)

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
