"""The router's cached view of the directory (the coordinator): which engines serve, which pairs route.

Invariants: after the first lookup no request pays the coordinator's round trip on its way to the
first token (an expired view is served while one refresh runs in the background); an invalidated
view refreshes at once in the background and a stale breaker costs a retry at worst, never a wrong
answer; a coordinator that is unreachable, or restarted and still settling, leaves the last view in
place (the error shows in readiness and status). The life cycle of the view: `DirectoryView`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from actors.routes import RouteTable

logger = logging.getLogger("raypd.router")


class Directory(Protocol):
    async def routes(self) -> RouteTable:
        """Live decode engines -> usable prefill engines, and every pair's breaker."""
        ...

    async def admit_probe(self, decode_id: str, prefill_id: str) -> bool:
        """Win the half-open pair's probe (granted once, cluster-wide)."""
        ...

    def prefill_failed(self, decode_id: str, prefill_id: str, reason: str) -> None:
        """Report an engine-caused prefill failure to the ledger (fire and forget)."""
        ...


class DirectoryView:
    """Life cycle of the view:

      first lookup   waits for the directory once (`waits` counts every lookup that
                     waited: the first, and those that asked for it with `force`);
      fresh          served as is for `ttl_s`;
      expired        served as is while one refresh runs in the background, so no
                     request pays the coordinator's round trip on its way to the
                     first token; the directory answers a current copy with nothing
                     (`Directory.routes` may return the same table again);
      invalidated    an outcome that may move a breaker was reported
                     (`invalidate()`): a refresh starts in the background at once
                     (and again after it, if one was already out); requests keep
                     the last view meanwhile: a stale breaker costs a retry at
                     worst, never a wrong answer;
      settling       a restarted coordinator whose engines are still registering
                     again: engines it does not list yet are kept from the last view;
      unreachable    the last view is kept (an empty one before any), the error is
                     shown in readiness and status.
    """

    def __init__(self, directory: Directory, ttl_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 on_refresh: Callable[[RouteTable], None] | None = None):
        self.directory = directory
        self.ttl_s = ttl_s
        self.clock = clock
        self.on_refresh = on_refresh  # the pool adopts the engines a fresh view lists
        self.table: RouteTable | None = None
        self.error: str | None = None
        self._at = -math.inf
        self._refreshing = False
        self._stale = False
        self._background: asyncio.Task | None = None
        self.waits = 0  # lookups that waited for the directory (the first one, forced ones)
        self._raw: RouteTable | None = None  # the directory's last answer, as it came

    async def routes(self, force: bool = False) -> RouteTable:
        """The view (see the class docstring); `force` waits for a fresh one."""
        if force or self.table is None:
            self.waits += 1
            self._stale = False
            await self._refresh()
        elif self._stale or self.clock() - self._at >= self.ttl_s:
            self._refresh_in_background()
        return self.table

    def invalidate(self) -> None:
        """An outcome was reported that may move a breaker: refresh in the background now."""
        self._stale = True
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (a synchronous caller): the next lookup starts it
        self._refresh_in_background()

    def _refresh_in_background(self) -> None:
        if not self._refreshing and self.table is not None:
            self._refreshing, self._stale = True, False
            self._background = asyncio.get_running_loop().create_task(self._refresh())

    async def settle(self) -> None:
        """Until the background refresh in flight (if any) landed (tests, shutdown)."""
        while self._background is not None and not self._background.done():
            await asyncio.shield(self._background)

    def generation_of(self, engine_id: str) -> int | None:
        return self.table.generations.get(engine_id) if self.table else None

    async def _refresh(self) -> None:
        try:
            fresh = await self.directory.routes()
            if fresh is self._raw and self.error is None:
                return  # the directory's table did not change: nothing to adopt (O(1) per poll)
            self._raw = fresh
            if fresh.settling and self.table is not None:
                kept = {d: ps for d, ps in self.table.decodes.items() if d not in fresh.decodes}
                fresh = replace(fresh, decodes={**kept, **fresh.decodes},
                                generations={**self.table.generations, **fresh.generations},
                                rates={**self.table.rates, **fresh.rates})
            self.table, self.error = fresh, None
            if self.on_refresh is not None:
                self.on_refresh(fresh)
        except Exception as exc:  # noqa: BLE001 - the directory being away must not crash routing
            self.error = f"{type(exc).__name__}: {exc}"
            logger.warning("directory unavailable, keeping the last view: %s", self.error)
            if self.table is None:
                self.table = RouteTable({})
        finally:
            self._at = self.clock()
            self._refreshing = False
            if self._stale and self.table is not None:  # invalidated while this one was out: once more
                self._refresh_in_background()
