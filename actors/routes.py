"""The directory the coordinator serves routers: usable prefill engines per decode engine, every
pair's breaker and every engine's own rates (`RouteTable`, versioned; `RouteDelta`: the breaker and
rate moves since a version).

Built by `actors.control.route_book.RouteBook`, read by `serving.routing` (the router's view) and
shown by `/metrics` and `raypd status`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from actors.rates import EngineRates


class BreakerState(StrEnum):
    """A pair's breaker (`actors.control.breaker`); the values are the `/metrics` and status labels."""

    CLOSED = "closed"
    HALF_OPEN = "half_open"
    OPEN = "open"


@dataclass(frozen=True)
class PairState:
    """One pair's breaker as routers, `/metrics` and `raypd status` see it."""

    prefill_id: str
    decode_id: str
    state: BreakerState
    failures: int  # consecutive
    opened_count: int
    last_reason: str = ""
    probe_in_flight: bool = False

    @property
    def pair(self) -> str:
        return f"{self.prefill_id}->{self.decode_id}"


@dataclass(frozen=True)
class PrefillRoute:
    """A prefill engine a decode engine may use now: breaker closed, or half-open with
    its probe not yet taken (then the router must win `admit_probe` first)."""

    prefill_id: str
    state: BreakerState = BreakerState.CLOSED


@dataclass(frozen=True)
class RouteTable:
    """What routers fetch from the coordinator: live decode engines -> usable prefill
    engines (compatible, breaker not open), and every pair's breaker."""

    decodes: dict[str, tuple[PrefillRoute, ...]]
    breakers: tuple[PairState, ...] = ()
    generations: dict[str, int] = field(default_factory=dict)  # engine -> its registered incarnation
    # The coordinator was just restarted and engines are still registering again: an engine
    # missing from this table may well be alive (routers keep their last view of it).
    settling: bool = False
    # Which table this is: the coordinator incarnation's epoch and the table's version in it
    # (a router holding (epoch, version) gets nothing back until the table changes).
    epoch: str = ""
    version: int = 0
    hangs: dict[str, int] = field(default_factory=dict)  # engine -> incarnations judged hung (and killed)
    # engine -> its rates and queues as it measured them itself (`actors.rates`): one model, every router
    rates: dict[str, EngineRates] = field(default_factory=dict)
    # engine -> its role: it died (or was killed for a restart) and has not registered again; an engine
    # that left on purpose (shut down, scaled in) is not here. What readiness reports as missing.
    lost: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class RouteDelta:
    """What changed in the coordinator's `RouteTable` since version `base` of the same epoch: breaker
    and rate moves only (a registration, removal or draining always sends the whole table). O(changes)."""

    epoch: str
    base: int
    version: int
    decodes: dict[str, tuple[PrefillRoute, ...]]  # decode engines whose usable prefill engines changed
    breakers: tuple[PairState, ...]  # pairs whose breaker moved (as they are now)
    settling: bool = False
    rates: dict[str, EngineRates] = field(default_factory=dict)  # engines whose rates moved (as they are now)

    def apply(self, table: RouteTable) -> RouteTable:
        """`table` (version `base`) brought to `version`; `table` itself is left as it was. A delta of rate
        moves alone shares `table`'s breakers (O(1): rates move far more often than breakers, and the
        breakers are every pair's, 16k at 256 engines: copying them costs the router's loop)."""
        breakers = table.breakers
        if self.breakers:
            moved = {(b.prefill_id, b.decode_id): b for b in self.breakers}
            breakers = tuple(moved.pop((b.prefill_id, b.decode_id), b) for b in breakers) + tuple(moved.values())
        decodes = {**table.decodes, **{d: ps for d, ps in self.decodes.items() if d in table.decodes}}
        return RouteTable(decodes, breakers, table.generations, self.settling, self.epoch, self.version,
                          table.hangs, {**table.rates, **self.rates} if self.rates else table.rates,
                          table.lost)
