"""An engine's rates to the coordinator: its one rate model and queues (`actors.rates.EngineRates`),
sent when they moved materially, so that every router reads the same numbers in its route table.

Life cycle of a record:

  measured   the engine's load meter fits its rates from every request it serves (`LoadMeter.rates()`);
  checked    every `interval_s`: sent when no record was sent yet, when it moved materially from
             the last one sent (`EngineRates.moved_from`: a coefficient by 10 %, the queue by a
             quarter, a stream more or less...), or `republish_s` after the last one (a restarted
             coordinator, a re-registration: `reset()` sends at the next check);
  published  `Coordinator.report_rates(engine_id, generation, rates)` keeps it in its route book
             when it moved materially from the kept one: the routers' table gets a new version, and
             a router polling with an older one gets it in a `RouteDelta` (O(changes));
  lost       a call that fails or passes `call_timeout_s` is counted and retried at the next check.

One call in flight at a time, off every request's path (a background task of the engine actor).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable

from actors.rates import EngineRates

logger = logging.getLogger("raypd.engine")


class RatesPublisher:
    def __init__(self, engine_id: str, rates: Callable[[], EngineRates],
                 send: Callable[[EngineRates], Awaitable[object]], interval_s: float = 0.5,
                 republish_s: float = 10.0, call_timeout_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self.engine_id, self.rates, self.send = engine_id, rates, send
        self.interval_s, self.republish_s, self.call_timeout_s = interval_s, republish_s, call_timeout_s
        self.clock = clock
        self.last: EngineRates | None = None  # the last record the coordinator took
        self.last_at = -math.inf
        self.sent = 0
        self.failed = 0
        self._task: asyncio.Task | None = None

    def due(self) -> EngineRates | None:
        """The record to send now, or None while the last one sent still stands."""
        rates = self.rates()
        if self.last is None or rates.moved_from(self.last) or self.clock() - self.last_at >= self.republish_s:
            return rates
        return None

    async def publish(self) -> bool:
        """One check: send the record if it is due; True when one was sent and answered."""
        rates = self.due()
        if rates is None:
            return False
        try:
            await asyncio.wait_for(self.send(rates), self.call_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the coordinator is away: the next check sends again
            self.failed += 1
            if self.failed == 1 or self.failed % 100 == 0:  # a coordinator away for long: not every check
                logger.info("%s: rates not published (%d times): %s", self.engine_id, self.failed, exc)
            return False
        self.last, self.last_at = rates, self.clock()
        self.sent += 1
        return True

    def reset(self) -> None:
        """The engine registered (again): the coordinator keeps nothing of it yet, send at the next check."""
        self.last = None

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await self.publish()
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
