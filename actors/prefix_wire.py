"""What crosses the wire about prefix-cache blocks: how an engine hashes them, its KV events, and
the index's changes as replicas receive them.

`HashScheme.block_hashes` computes vLLM's own block hashes, so a router can ask how many leading
blocks of a prompt each engine holds without asking the engines. Three parties share these types
and nothing else: engines relay `KVEventsBatch`es (`actors.engine.vllm.kv_events`), the owner
(`actors.control.prefix_index.PrefixIndex`) logs every change as an `IndexOp`, routers
(`serving.routing.prefix_replica`) catch up with `IndexUpdate`s from their `IndexCursor`; keeping
them here lets each side import the wire without the others' modules. Pure Python: no Ray, no vLLM.
"""

from __future__ import annotations

import hashlib
import itertools
import pickle
from array import array
from collections.abc import Iterator, Sequence
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
    """How one engine hashes its blocks: block size, hash algorithm, NONE_HASH seed.

    vLLM (0.32) names a full KV block by a hash chained over the prompt's token ids:
    `hash(parent_hash, tuple(block_token_ids), extra_keys)`, the first block's parent
    being `NONE_HASH = hash(seed)`; the default algorithm is `sha256` over the
    pickled tuple and the seed is "vllm-none-hash" (or PYTHONHASHSEED). Its KV
    cache events (`BlockStored` / `BlockRemoved` / `AllBlocksCleared`) report the
    same hashes, by default as the low 64 bits (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`).
    `HashScheme.block_hashes` computes them here, so a router can ask "how many
    leading blocks of this prompt does each engine hold" without asking the engines.

    Three parties share these types and nothing else: engines relay `KVEventsBatch`es
    (`actors.engine.vllm.kv_events`), the owner (`actors.control.prefix_index.PrefixIndex`,
    in the coordinator) logs every change as an `IndexOp`, routers
    (`serving.routing.prefix_replica`) catch up with `IndexUpdate`s from their `IndexCursor`.
    Keeping them here lets each side import the wire without the others' modules.
    Pure Python: no Ray, no vLLM.
    """

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


class PackedOps(Sequence[IndexOp]):
    """A run of `IndexOp`s as they travel: every hash in one bytes object of 64-bit words, each op's
    engine, kind, scheme and hash count beside it. Unpickling one is a few objects, not one int per
    block hash (unpickling those held a router's loop at 256 engines: docs/benchmarks.md); each op's hashes become ints when the op is read, so a replica applying in slices
    (`PrefixReplica.apply_in_slices`) spreads that work over its loop's turns."""

    __slots__ = ("engine_ids", "kinds", "schemes", "counts", "words", "_starts")

    def __init__(self, engine_ids: list[str], kinds: str, schemes: list[HashScheme | None], counts: bytes,
                 words: bytes):
        self.engine_ids, self.kinds, self.schemes, self.counts, self.words = engine_ids, kinds, schemes, counts, words
        self._starts: list[int] | None = None

    @classmethod
    def of(cls, ops: Sequence[IndexOp]) -> "PackedOps | tuple[IndexOp, ...]":
        """`ops` packed; as a tuple when empty or a hash is not a 64-bit key (nothing to gain, or to lose)."""
        if not ops:
            return ()
        try:
            words = array("Q", itertools.chain.from_iterable(op.hashes for op in ops))
        except (OverflowError, TypeError):
            return tuple(ops)
        return cls([op.engine_id for op in ops], "".join(_KIND_CODE[op.kind] for op in ops),
                   [op.scheme for op in ops], array("I", [len(op.hashes) for op in ops]).tobytes(), words.tobytes())

    def __len__(self) -> int:
        return len(self.engine_ids)

    def __getitem__(self, i: int) -> IndexOp:  # type: ignore[override] - one op (nobody slices)
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        if self._starts is None:
            self._starts = list(itertools.accumulate(memoryview(self.counts).cast("I"), initial=0))
        hashes = tuple(memoryview(self.words).cast("Q")[self._starts[i]:self._starts[i + 1]])
        return IndexOp(self.engine_ids[i], _KIND_NAME[self.kinds[i]], hashes, self.schemes[i])

    def __iter__(self) -> Iterator[IndexOp]:
        words, start = memoryview(self.words).cast("Q"), 0
        for engine_id, kind, scheme, n in zip(self.engine_ids, self.kinds, self.schemes,
                                              memoryview(self.counts).cast("I")):
            yield IndexOp(engine_id, _KIND_NAME[kind], tuple(words[start:start + n]), scheme)
            start += n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __getstate__(self):
        return None, {k: getattr(self, k) for k in self.__slots__ if k != "_starts"}

    def __setstate__(self, state) -> None:
        for k, v in state[1].items():
            setattr(self, k, v)
        self._starts = None


_KIND_CODE = {"store": "s", "remove": "r", "clear": "c"}
_KIND_NAME = {v: k for k, v in _KIND_CODE.items()}


@dataclass(frozen=True)
class IndexUpdate:
    """Ops that bring a replica from its cursor to `cursor`; `full`: clear it first. The owner sends
    them packed (`PackedOps`)."""

    cursor: IndexCursor
    ops: Sequence[IndexOp]
    full: bool
