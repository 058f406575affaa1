"""How a synthetic engine outlives its rank actors' deaths (`SyntheticEngine`'s rank supervision).

One pending `watch()` call per rank sees a death at once: held prefill blocks are freed (their
KV is gone with the rank), the engine waits for Ray's restart of that rank (at most
`rank_max_restarts`), then, a new incarnation with fresh NIXL agents, registers its new
handshakes (`on_new_incarnation`). A rank Ray will not restart marks the engine dead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

import ray

logger = logging.getLogger("raypd.synthetic")


class RankSupervision:
    """Mixed into `SyntheticEngine`: the state below, and `abort`, are its own (set in its `__init__`)."""

    engine_id: str
    ranks: list[Any]
    handshakes: list[bytes]
    rank_pids: list[int]
    closed: bool
    incarnation: int
    dead: str | None
    on_new_incarnation: Callable[[], Awaitable[Any]] | None
    _held: dict[str, tuple[list[int], set[int]]]
    _ready: asyncio.Event
    _replacing: int
    _rank_watchers: list[asyncio.Task]

    async def ready(self) -> None:
        """Until no rank is being replaced."""
        await self._ready.wait()

    async def _watch_rank(self, i: int) -> None:
        try:
            await self.ranks[i].watch.options(max_task_retries=0).remote()
        except asyncio.CancelledError:
            return
        except ray.exceptions.RayError as exc:
            if not self.closed:
                await self._rank_died(i, exc)

    async def _rank_died(self, i: int, exc: Exception) -> None:
        """A rank actor died: free what it held, wait for Ray to restart it, rejoin."""
        logger.warning("%s: rank %d died (%s); replacing it", self.engine_id, i, type(exc).__name__)
        self._ready.clear()
        self._replacing += 1
        self.incarnation += 1
        live = [r for j, r in enumerate(self.ranks) if j != i]
        for req_id in list(self._held):  # their KV on that rank is gone: nobody can read them
            await self.abort(req_id, live)
        try:
            self.handshakes[i] = await self._once_restarted(self.ranks[i].handshake)
            self.rank_pids[i] = await self._once_restarted(self.ranks[i].pid)
        except ray.exceptions.RayError as err:
            self.dead = f"rank {i} died and was not restarted ({type(err).__name__})"
            logger.error("%s: %s", self.engine_id, self.dead)
        self._replacing -= 1
        if self.closed:
            return
        if self.dead is None:
            self._rank_watchers[i] = asyncio.get_running_loop().create_task(self._watch_rank(i))
            logger.warning("%s: rank %d is back (incarnation %d)", self.engine_id, i, self.incarnation)
        if self._replacing:
            return  # another rank is still being replaced: that one rejoins for both
        self._ready.set()  # (a dead engine too: its requests fail instead of waiting)
        if self.on_new_incarnation is not None:
            try:
                await self.on_new_incarnation()
            except ray.exceptions.RayError as err:  # the coordinator is away: the engine registers later
                logger.warning("%s: registering the new incarnation failed: %s", self.engine_id, err)

    @staticmethod
    async def _once_restarted(method: Any, timeout_s: float = 120.0) -> Any:
        """Call a rank's method once Ray restarted it: "unavailable" while it restarts, "died"
        (raised) when it will not come back."""
        deadline, delay = time.monotonic() + timeout_s, 0.05
        while True:
            try:
                return await method.remote()
            except ray.exceptions.ActorUnavailableError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
