"""A router's probes of half-open pairs, won off the request path where another engine can serve.

A pair whose breaker is half-open takes one probe request, granted once cluster-wide by the
coordinator's ledger (`Directory.admit_probe`); the probe's outcome closes or reopens the breaker.
Asking is a coordinator round trip, slow on a busy coordinator (docs/benchmarks.md, control plane).
Invariants: a request never waits for an ask while a closed pair can serve it (the ask runs in a
task of its own and its grant is held for the next request); a refused or unanswered ask is not
repeated for `hold_s`. The life cycle of one pair's probe: `ProbeGrants`.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable

logger = logging.getLogger("raypd.router")

Pair = tuple[str, str]  # (decode engine, prefill engine)


class ProbeGrants:
    """1. asked      a request ranked the half-open pair ahead of the closed one it then took:
                    `ask_later` asks the ledger in a task of its own (one ask per pair at a time);
      2. held       granted: the grant is held for `hold_s`, well within the ledger's probe window
                    (after which the ledger grants the probe to the next caller, here or elsewhere);
      3. carried    the next request ranked to that pair takes the grant (`take`) and runs there;
      4. lapsed     no request came within `hold_s`: the grant is dropped, and the ledger's window
                    lets another caller probe later.

    A refused ask (another router holds the probe) or one left unanswered is not repeated for `hold_s`:
    the ledger would refuse again within its window, and each ask is a call on a busy coordinator.

    A request with no closed pair to take waits for the probe itself (`ask_now`, within its deadline,
    joining an ask already out), as there is nothing else it could do first.
    """

    def __init__(self, ask: Callable[[str, str], Awaitable[bool]], timeout_s: float, hold_s: float,
                 clock: Callable[[], float]):
        self.ask = ask  # the ledger's admit_probe
        self.timeout_s = timeout_s  # an ask that has no answer by then counts as refused
        self.hold_s = hold_s
        self.clock = clock
        self._held: dict[Pair, float] = {}  # granted pair -> when the grant lapses here
        self._refused: dict[Pair, float] = {}  # refused (or unanswered) pair -> when it may be asked again
        self._asking: dict[Pair, asyncio.Task] = {}
        self.asked = self.waited = self.carried = 0  # asks sent; requests that waited; grants carried

    def take(self, decode_id: str, prefill_id: str) -> bool:
        """Whether this router holds a live grant for the pair; it is consumed (one request carries it)."""
        until = self._held.pop((decode_id, prefill_id), None)
        if until is None or self.clock() >= until:
            return False
        self.carried += 1
        return True

    def ask_later(self, decode_id: str, prefill_id: str) -> None:
        """Ask for the pair's probe in the background (not when one is held or asked already)."""
        pair, now = (decode_id, prefill_id), self.clock()
        if pair in self._asking or self._held.get(pair, -1.0) > now or self._refused.get(pair, -1.0) > now:
            return
        # a fresh context: the ask belongs to no request (tracing and accounting see none)
        task = asyncio.get_running_loop().create_task(self._ask(pair), context=contextvars.Context())
        self._asking[pair] = task
        task.add_done_callback(lambda _t, pair=pair: self._asking.pop(pair, None))

    async def ask_now(self, decode_id: str, prefill_id: str) -> bool:
        """Wait for the pair's probe (no closed pair to take instead): joins an ask already out; True
        once won for this request (the grant is consumed); False at once when refused within `hold_s`."""
        if self.take(decode_id, prefill_id):
            return True
        pair = (decode_id, prefill_id)
        if pair not in self._asking:
            self.ask_later(decode_id, prefill_id)
        task = self._asking.get(pair)
        if task is None:
            return False
        self.waited += 1
        await asyncio.wait({task}, timeout=self.timeout_s)  # the ask itself is bounded by timeout_s
        return self.take(decode_id, prefill_id)

    async def _ask(self, pair: Pair) -> None:
        self.asked += 1
        try:
            granted = await asyncio.wait_for(self.ask(*pair), self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - no answer in time: not granted, asked again later
            logger.info("probe of %s->%s not admitted: %s", pair[1], pair[0], exc)
            granted = False
        if granted:
            self._held[pair] = self.clock() + self.hold_s
            self._refused.pop(pair, None)
        else:
            self._refused[pair] = self.clock() + self.hold_s

    async def drain(self) -> None:
        """Until the asks out have landed (tests, shutdown)."""
        if self._asking:
            await asyncio.wait(set(self._asking.values()))
