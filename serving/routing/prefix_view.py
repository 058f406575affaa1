"""A router's copy of the coordinator's prefix index (`actors.control.prefix_index`), kept in step by deltas.

Life cycle: the first `refresh()` fetches a snapshot; later ones, at most every
`refresh_s` (`refresh_soon()` starts one in the background: the request path
never waits), fetch only the ops after the copy's cursor (a snapshot again when the
owner's log no longer reaches back or the owner restarted). Concurrent requests
share one fetch; a failed fetch keeps the last copy (routing goes on by load and
what is known) and is retried at the next refresh.

The router's own placements count at once (`note_held`): the prompt it just routed to an
engine, and the whole conversation once its answer ended there, are claimed in the copy
before the engine's KV events arrive (an agent's next turn comes within milliseconds of
the answer; the events take a relay and a refresh), until those events confirm or evict them. The copy is a `PrefixReplica`
(inverted: block -> engines); an update is applied `slice_hashes` hashes at a time with
the event loop free in between, so requests arriving meanwhile are not held up by
it (they may see the copy half updated: a cache miss at worst).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence

from actors.prefix_wire import IndexCursor, IndexUpdate
from serving.routing.prefix_replica import PrefixReplica

logger = logging.getLogger("raypd.router")


class PrefixCacheView:
    def __init__(self, fetch: Callable[[IndexCursor | None], Awaitable[IndexUpdate]], refresh_s: float = 0.1,
                 clock: Callable[[], float] = time.monotonic, slice_hashes: int = 500):
        self.fetch, self.refresh_s, self.clock = fetch, refresh_s, clock
        # block hashes applied between two turns of the event loop: bounds how long a request
        # arriving meanwhile waits (docs/benchmarks.md, control plane)
        self.slice_hashes = slice_hashes
        self.index = PrefixReplica()  # mirrors the owner's evictions
        self.upkeep_s = 0.0  # time spent applying updates to the copy (the event loop's, in slices)
        self._synced = False
        self._at = -math.inf
        self._inflight: asyncio.Future | None = None
        self._background: asyncio.Task | None = None
        self.error: str | None = None

    def refresh_soon(self) -> None:
        """A refresh in the background when the copy is older than `refresh_s` (nobody waits for it)."""
        if (self._background is None or self._background.done()) and self.clock() - self._at >= self.refresh_s:
            self._background = asyncio.get_running_loop().create_task(self.refresh())

    async def refresh(self) -> None:
        if self._inflight is not None:
            await asyncio.shield(self._inflight)
            return
        if self.clock() - self._at < self.refresh_s:
            return
        self._inflight = asyncio.get_running_loop().create_future()
        try:
            update = await self.fetch(self.index.cursor if self._synced else None)
            await self._apply(update)
            self._synced, self.error = True, None
        except Exception as exc:  # noqa: BLE001 - the owner being away must not stop routing
            self.error = f"{type(exc).__name__}: {exc}"
            logger.info("prefix index not refreshed: %s", self.error)
        finally:
            self._at = self.clock()
            self._inflight.set_result(None)
            self._inflight = None

    async def _apply(self, update: IndexUpdate) -> None:
        self.index.expire_claims(self.clock())
        t0 = time.perf_counter()
        for _ in self.index.apply_in_slices(update, self.slice_hashes):
            self.upkeep_s += time.perf_counter() - t0
            await asyncio.sleep(0)  # let requests run between slices
            t0 = time.perf_counter()
        self.upkeep_s += time.perf_counter() - t0

    def note_held(self, engine_id: str, token_ids: Sequence[int]) -> int:
        """`engine_id` now caches `token_ids` (this router placed them there); blocks claimed."""
        return self.index.note_held(engine_id, token_ids, self.clock())

    def held_tokens(self, token_ids: Sequence[int], engine_ids: Iterable[str] | None = None) -> dict[str, int]:
        """Per engine (of `engine_ids`, default all) holding at least the prompt's first block: prompt
        tokens whose blocks it holds (engines left out hold none; O(what is held), not O(engines))."""
        return self.index.cached_prefix_tokens(token_ids, engine_ids)

    def cached_tokens(self, token_ids: Sequence[int], engine_ids: Iterable[str]) -> dict[str, int]:
        """Per engine: prompt tokens whose KV blocks it holds (0 for engines the index does not know)."""
        engine_ids = list(engine_ids)
        known = self.index.cached_prefix_tokens(token_ids, engine_ids)
        return {e: known.get(e, 0) for e in engine_ids}
