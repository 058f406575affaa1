"""Why an event loop was late: its lag and the garbage collector's pauses, logged when long.

A stream's tokens and a new request's first bytes wait whenever the process's
event loop is busy elsewhere. `LoopWatch` (on with `http.trace`) measures the
loop's lag with one timer at a time (a late wake-up by more than `report_s`
is logged with what the collector did meanwhile) and times every collection
through `gc.callbacks`; `snapshot()` gives the totals (`raypd status`-style
dicts). The timer wakes every `tick_s` only while the process serves requests
(`busy()` is called per request); an idle process stays asleep.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from typing import Any

logger = logging.getLogger("raypd.loop")


class LoopWatch:
    def __init__(self, name: str, tick_s: float = 0.05, report_s: float = 0.1, active_s: float = 30.0,
                 clock: Any = time.monotonic):
        self.name, self.tick_s, self.report_s, self.active_s, self.clock = name, tick_s, report_s, active_s, clock
        self.max_lag_s = 0.0
        self.late = 0  # wake-ups later than report_s
        self.gc_pauses = {0: 0, 1: 0, 2: 0}
        self.gc_s = {0: 0.0, 1: 0.0, 2: 0.0}
        self.gc_max_s = 0.0
        self._gc_started: float | None = None
        self._gc_recent = 0.0  # collection time since the last tick
        self._until = 0.0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._gc_callback not in gc.callbacks:
            gc.callbacks.append(self._gc_callback)

    def stop(self) -> None:
        if self._gc_callback in gc.callbacks:
            gc.callbacks.remove(self._gc_callback)
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def busy(self) -> None:
        """A request arrived: watch the loop for the next `active_s`."""
        self._until = self.clock() + self.active_s
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._tick())

    def _gc_callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = self.clock()
            return
        if self._gc_started is None:
            return
        took = self.clock() - self._gc_started
        self._gc_started = None
        gen = info.get("generation", 2)
        self.gc_pauses[gen] = self.gc_pauses.get(gen, 0) + 1
        self.gc_s[gen] = self.gc_s.get(gen, 0.0) + took
        self.gc_max_s = max(self.gc_max_s, took)
        self._gc_recent += took
        if took >= self.report_s:
            logger.warning("%s: gc generation %d took %.3f s (collected %d)", self.name, gen, took,
                           info.get("collected", 0))

    async def _tick(self) -> None:
        while self.clock() < self._until:
            due = self.clock() + self.tick_s
            self._gc_recent = 0.0
            await asyncio.sleep(self.tick_s)
            lag = self.clock() - due
            self.max_lag_s = max(self.max_lag_s, lag)
            if lag >= self.report_s:
                self.late += 1
                logger.warning("%s: event loop %.3f s late (gc %.3f s of it)", self.name, lag, self._gc_recent)

    def snapshot(self) -> dict[str, Any]:
        return {"max_lag_s": round(self.max_lag_s, 4), "late": self.late, "gc_pauses": dict(self.gc_pauses),
                "gc_s": {k: round(v, 4) for k, v in self.gc_s.items()}, "gc_max_s": round(self.gc_max_s, 4)}
