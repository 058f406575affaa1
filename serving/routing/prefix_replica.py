"""A router's replica of the prefix index, inverted for lookups: block hash -> the engines holding it.

The owner (`actors.control.prefix_index.PrefixIndex`) keeps each engine's blocks in LRU order; a
router only asks how many leading blocks of a prompt each engine holds, so its copy keeps one entry
per distinct block: the hash and a bitmask of the engines holding it (a shared system prompt is
stored once). Ops: "store" sets an engine's bit, "remove" clears it (a hash nobody holds is
dropped), "clear" (the engine died, restarted or lost events) clears its bit everywhere.
A router's own placements are claimed at once (`note_held`, llm-d's approximate prefix scoring) and
live for `claim_ttl_s` or until a "remove"/"clear" of the engine. An op costs O(its hashes), a
lookup O(leading blocks held + their engines); a prompt is hashed once per scheme (`PromptHashes`);
the maps are split into `SHARDS` dicts so a dict's rebuild holds the event loop for a fraction of the
whole (docs/benchmarks.md). Pure Python: no Ray, no vLLM.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence

from actors.prefix_wire import HashScheme, IndexCursor, IndexOp, IndexUpdate

SHARDS = 64  # per-block maps split by `hash & SHARD_MASK` (a power of two)
SHARD_MASK = SHARDS - 1


def _shards() -> list[dict]:
    return [{} for _ in range(SHARDS)]


class PromptHashes:
    """One prompt's block hashes under one scheme, computed once and only as far as anyone iterated."""

    __slots__ = ("token_ids", "_done", "_rest")

    def __init__(self, scheme: HashScheme, token_ids: tuple[int, ...]):
        self.token_ids, self._done = token_ids, []
        self._rest: Iterator[int] | None = scheme.iter_block_hashes(token_ids)

    def __iter__(self) -> Iterator[int]:
        done, i = self._done, 0
        while True:
            if i < len(done):
                yield done[i]
            elif self._rest is None:
                return
            else:
                key = next(self._rest, None)
                if key is None:
                    self._rest = None
                    return
                done.append(key)
                yield key
            i += 1


class PrefixReplica:
    def __init__(self, claim_ttl_s: float = 10.0) -> None:
        self.claim_ttl_s = claim_ttl_s  # how long a router's own claim stands without the engine's events
        self.clear()

    def clear(self) -> None:
        """Forget everything (a full snapshot follows)."""
        self.epoch, self.seq = "", 0
        self._holders: list[dict[int, int]] = _shards()  # block hash -> bitmask of the engines holding it
        self._bit: dict[str, int] = {}  # engine -> its bit
        self._engine_at: list[str | None] = []  # bit -> engine
        self._free: list[int] = []
        self._scheme: dict[str, HashScheme] = {}
        self._scheme_mask: dict[HashScheme, int] = {}  # scheme -> the engines hashing with it
        self._count: dict[str, int] = {}  # engine -> blocks held
        self._claimed: list[dict[int, int]] = _shards()  # block hash -> bitmask of engines this router placed it on
        self._claimed_blocks = 0  # hashes in `_claimed`
        self._claims: deque[tuple[float, str, tuple[int, ...]]] = deque()  # (expiry, engine, hashes), oldest first
        # engine's bit -> block hash -> its latest claim's expiry (int keys: a (hash, bit) tuple per
        # claimed block was a third of the router's young-GC pressure at 256 engines)
        self._claim_until: dict[int, dict[int, float]] = {}
        self._last_prompt: dict[HashScheme, PromptHashes] = {}  # the last prompt hashed, per scheme

    @property
    def cursor(self) -> IndexCursor:
        return IndexCursor(self.epoch, self.seq)

    # ------------------------------------------------------------ updates
    def apply_update(self, update: IndexUpdate) -> None:
        for _ in self.apply_in_slices(update, 0):
            pass

    def apply_in_slices(self, update: IndexUpdate, slice_hashes: int) -> Iterator[None]:
        """Apply `update`, yielding after every `slice_hashes` hashes (0: never) so that a caller on an
        event loop can let requests run in between; the cursor moves once the last op is applied."""
        if update.full:
            self.clear()
        done = 0
        for op in update.ops:
            self.apply_ops((op,))
            done += 1 + len(op.hashes)
            if slice_hashes and done >= slice_hashes:
                done = 0
                yield
        self.epoch, self.seq = update.cursor.epoch, update.cursor.seq

    def apply_ops(self, ops: Iterable[IndexOp]) -> None:
        for op in ops:
            if op.kind == "store":
                self._store(op.engine_id, op.hashes, op.scheme)
            elif op.kind == "remove":
                self._remove(op.engine_id, op.hashes)
            else:
                self._clear_engine(op.engine_id)

    def _store(self, engine_id: str, hashes: tuple[int, ...], scheme: HashScheme | None) -> None:
        if self._scheme.get(engine_id, scheme) != scheme:
            self._clear_engine(engine_id)  # a new scheme: its old hashes mean nothing now
        bit = self._bit.get(engine_id)
        if bit is None:
            bit = self._free.pop() if self._free else len(self._engine_at)
            if bit == len(self._engine_at):
                self._engine_at.append(None)
            self._bit[engine_id], self._engine_at[bit] = bit, engine_id
            self._scheme[engine_id], self._count[engine_id] = scheme, 0
            self._scheme_mask[scheme] = self._scheme_mask.get(scheme, 0) | (1 << bit)
        mask, holders, added = 1 << bit, self._holders, 0
        for h in hashes:
            shard = holders[h & SHARD_MASK]
            cur = shard.get(h, 0)
            if not cur & mask:
                shard[h] = cur | mask
                added += 1
        self._count[engine_id] += added

    def _remove(self, engine_id: str, hashes: tuple[int, ...]) -> None:
        bit = self._bit.get(engine_id)
        if bit is None:
            return
        self._unclaim(1 << bit, hashes)
        mask, holders, gone = 1 << bit, self._holders, 0
        for h in hashes:
            shard = holders[h & SHARD_MASK]
            cur = shard.get(h, 0)
            if cur & mask:
                gone += 1
                if cur == mask:
                    del shard[h]
                else:
                    shard[h] = cur ^ mask
        self._count[engine_id] -= gone

    def _clear_engine(self, engine_id: str) -> None:
        bit = self._bit.pop(engine_id, None)
        if bit is None:
            return
        mask = 1 << bit
        self._unclaim(mask, [h for shard in self._claimed for h, cur in shard.items() if cur & mask])
        self._claim_until.pop(bit, None)
        for shard in self._holders:
            for h, cur in list(shard.items()):
                if cur & mask:
                    if cur == mask:
                        del shard[h]
                    else:
                        shard[h] = cur ^ mask
        self._engine_at[bit] = None
        self._free.append(bit)
        scheme = self._scheme.pop(engine_id)
        self._scheme_mask[scheme] &= ~mask
        if not self._scheme_mask[scheme]:
            del self._scheme_mask[scheme]
        del self._count[engine_id]

    # ------------------------------------------------------- own claims
    def note_held(self, engine_id: str, token_ids: Sequence[int], now: float) -> int:
        """This router placed `token_ids` (tokens whose KV the engine computes) on `engine_id`: their full
        blocks count as held there until the engine's events confirm them (or `claim_ttl_s` passes).
        Hashed with the engine's scheme, or the deployment's one scheme for an engine that has reported
        none yet; returns the blocks claimed."""
        self.expire_claims(now)
        scheme = self._scheme.get(engine_id)
        if scheme is None:
            if len(self._scheme_mask) != 1:
                return 0  # no scheme to hash with: the events will tell
            scheme = next(iter(self._scheme_mask))
            self._store(engine_id, (), scheme)  # the engine gets its bit (holding nothing confirmed)
        hashes = tuple(self._hashes(scheme, token_ids))
        bit, until = self._bit[engine_id], now + self.claim_ttl_s
        mask, claimed = 1 << bit, self._claimed
        claim_until = self._claim_until.setdefault(bit, {})
        for h in hashes:
            shard = claimed[h & SHARD_MASK]
            cur = shard.get(h, 0)
            if not cur:
                self._claimed_blocks += 1
            shard[h] = cur | mask
            claim_until[h] = until
        self._claims.append((until, engine_id, hashes))
        return len(hashes)

    def expire_claims(self, now: float) -> None:
        """Drop claims older than `claim_ttl_s` (a later claim of the same block stands)."""
        while self._claims and self._claims[0][0] <= now:
            _, engine_id, hashes = self._claims.popleft()
            bit = self._bit.get(engine_id)
            if bit is not None:
                until = self._claim_until.get(bit, {})
                self._unclaim(1 << bit, [h for h in hashes if until.get(h, 0.0) <= now])

    def _unclaim(self, mask: int, hashes: Iterable[int]) -> None:
        if not self._claimed_blocks:
            return
        claimed, claim_until = self._claimed, self._claim_until.get(mask.bit_length() - 1, {})
        for h in hashes:
            shard = claimed[h & SHARD_MASK]
            cur = shard.get(h, 0)
            if cur & mask:
                claim_until.pop(h, None)
                if cur == mask:
                    del shard[h]
                    self._claimed_blocks -= 1
                else:
                    shard[h] = cur ^ mask

    # -------------------------------------------------------------- query
    def engines(self) -> dict[str, int]:
        """Engine -> blocks it holds."""
        return dict(self._count)

    def cached_prefix_tokens(self, token_ids: Sequence[int], engine_ids: Iterable[str] | None = None
                             ) -> dict[str, int]:
        """Per engine holding at least the prompt's first block: the prompt tokens at its start whose
        blocks it holds (as vLLM, at most `len(token_ids) - 1`). Engines not listed hold none."""
        wanted = -1  # every engine
        if engine_ids is not None:
            wanted, bits = 0, self._bit
            for e in engine_ids:
                bit = bits.get(e)
                if bit is not None:
                    wanted |= 1 << bit
        out: dict[str, int] = {}
        cap = max(0, len(token_ids) - 1)
        for scheme, engines in self._scheme_mask.items():
            alive, n = wanted & engines, 0
            if not alive:
                continue
            holders, claimed = self._holders, self._claimed
            for key in self._hashes(scheme, token_ids):
                held = alive & (holders[key & SHARD_MASK].get(key, 0) | claimed[key & SHARD_MASK].get(key, 0))
                self._settle(alive & ~held, n, scheme.block_size, cap, out)
                alive = held
                if not alive:
                    break
                n += 1
            self._settle(alive, n, scheme.block_size, cap, out)
        return out

    def _hashes(self, scheme: HashScheme, token_ids: Sequence[int]) -> Iterable[int]:
        """The prompt's block hashes; the last prompt's kept (the same tuple: a decision's lookup and
        its claims). A list may change in place between calls: hashed afresh every time."""
        if not isinstance(token_ids, tuple):
            return scheme.iter_block_hashes(token_ids)
        last = self._last_prompt.get(scheme)
        if last is None or last.token_ids is not token_ids:
            last = self._last_prompt[scheme] = PromptHashes(scheme, token_ids)
        return last

    def _settle(self, mask: int, blocks: int, block_size: int, cap: int, out: dict[str, int]) -> None:
        """Engines in `mask` hold exactly `blocks` leading blocks."""
        if not blocks:
            return
        while mask:
            low = mask & -mask
            out[self._engine_at[low.bit_length() - 1]] = min(blocks * block_size, cap)
            mask ^= low
