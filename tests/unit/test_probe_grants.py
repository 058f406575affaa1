"""serving.routing.probes: a half-open pair's probe asked once at a time, held for `hold_s`, carried by
one request; a refused or unanswered ask leaves nothing held."""

from __future__ import annotations

import asyncio

from serving.routing.probes import ProbeGrants


class Ledger:
    def __init__(self, answers: list[bool | None]):
        self.answers, self.calls = answers, 0  # None: never answers

    async def admit_probe(self, decode_id: str, prefill_id: str) -> bool:
        self.calls += 1
        answer = self.answers.pop(0)
        if answer is None:
            await asyncio.sleep(10)
        return answer


def test_one_ask_at_a_time_and_a_grant_is_carried_once_within_its_hold():
    async def go():
        now = [0.0]
        ledger = Ledger([True, True])
        grants = ProbeGrants(ledger.admit_probe, timeout_s=1.0, hold_s=2.0, clock=lambda: now[0])
        grants.ask_later("d0", "p0")
        grants.ask_later("d0", "p0")  # one ask out already
        await grants.drain()
        grants.ask_later("d0", "p0")  # a grant held: nothing to ask
        assert ledger.calls == 1
        first, again = grants.take("d0", "p0"), grants.take("d0", "p0")
        grants.ask_later("d0", "p0")
        await grants.drain()
        now[0] += 2.0  # the hold lapsed: the ledger's window will let another caller probe
        lapsed = grants.take("d0", "p0")
        return first, again, lapsed, ledger.calls, grants.carried

    assert asyncio.run(go()) == (True, False, False, 2, 1)


def test_a_refused_or_unanswered_ask_holds_nothing_is_not_repeated_within_the_hold_and_a_wait_is_bounded():
    async def go():
        now = [0.0]
        ledger = Ledger([False, None])
        grants = ProbeGrants(ledger.admit_probe, timeout_s=0.05, hold_s=2.0, clock=lambda: now[0])
        refused = await grants.ask_now("d0", "p0")
        grants.ask_later("d0", "p0")  # refused within the hold: the ledger is not asked again
        again = await grants.ask_now("d0", "p0")
        asked_within_hold = ledger.calls
        now[0] += 2.0
        t0 = asyncio.get_running_loop().time()
        unanswered = await grants.ask_now("d0", "p0")
        took = asyncio.get_running_loop().time() - t0
        await grants.drain()
        return refused, again, asked_within_hold, unanswered, took, grants.waited, grants.asked

    refused, again, asked_within_hold, unanswered, took, waited, asked = asyncio.run(go())
    assert (refused, again, asked_within_hold, unanswered) == (False, False, 1, False)
    assert (waited, asked) == (2, 2) and took < 0.5
