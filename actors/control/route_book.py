"""The (prefill, decode) pairs the coordinator judged, and the routers' `RouteTable` built from them.

Every pair a new engine incarnation forms is judged once (`pair_problem`) and each routable pair
gets its breaker in the ledger; engines' own rates are kept when they moved materially. Invariants:
the table is rebuilt only on a change (and only the moved decode engines' rows after breaker or
rate moves); a router whose copy is current gets nothing back, else a `RouteDelta` when the change
log reaches back, else the whole table; every router at one version reads the same numbers. Pure:
no Ray; the coordinator owns one. The life cycle of the table: `RouteBook`.
"""

from __future__ import annotations

import logging
import uuid
from collections import deque
from collections.abc import Mapping

from actors.control.ledger import TransferLedger
from actors.control.registry import EngineEntry
from actors.kv.plan.compat import pair_problem
from actors.rates import EngineRates
from actors.routes import BreakerState, PrefillRoute, RouteDelta, RouteTable

logger = logging.getLogger("raypd.coordinator")


class RouteBook:
    """Life cycle of the table:

      judged    `add(entry, engines)`: every pair a new engine incarnation forms with the
                registered engines is judged once (`pair_problem`: compatible or the reason
                not); each routable pair gets its breaker in the ledger;
      dropped   `drop(engine_id)`: an engine's pairs go with it (O(its pairs));
      rated     `set_rates(engine, rates)`: an engine's own rates and queues (`actors.rates`),
                kept only when they moved materially from the kept ones (`EngineRates.moved_from`),
                so every router at one version reads the same numbers; dropped with the engine;
      changed   a registration, a removal, draining (`changed()`), a visible breaker move
                (the ledger's `changes`), a move by time alone (`ledger.advance()`: a
                cooldown or a probe window ended), kept rates, or the end of the post-restart settling;
      built     `table(...)`: the cached table while nothing changed; on a change the next
                version of this book's epoch: after breaker or rate moves only the decode engines of
                the moved pairs are recomputed (O(their prefill engines)); after a directory
                change the whole table is rebuilt, O(pairs);
      polled    `since(epoch, version, ...)`: None while a router's copy is current (O(1),
                nothing shipped); a `RouteDelta` (O(changes)) when only breakers and rates moved
                since that version and the change log still reaches back; else the whole table.

    Pure: no Ray; the coordinator owns one.
    """

    def __init__(self, ledger: TransferLedger, log_versions: int = 64):
        self.ledger = ledger
        self.epoch = uuid.uuid4().hex  # a restarted coordinator is a new epoch: routers take its table whole
        self.version = 0
        self.builds = 0
        self.problems: dict[tuple[str, str], str | None] = {}  # (prefill, decode) -> None (ok) or the reason
        self._prefills_of: dict[str, dict[str, str | None]] = {}  # decode -> prefill -> problem
        self._decodes_of: dict[str, set[str]] = {}  # prefill -> decodes it pairs with
        self._changes = 0
        self._whole = True  # the directory changed: the next build is a whole one
        self._table: RouteTable | None = None
        self._key: tuple[int, int, bool, int, int] | None = None
        self._rates: dict[str, EngineRates] = {}  # engine -> the rates it published, as kept
        self._lost: dict[str, str] = {}  # engine -> role: died, not registered again (RouteTable.lost)
        self._rated: set[str] = set()  # engines whose kept rates moved since the last build
        self._rate_changes = 0
        # per version built: (decode engines recomputed, pairs moved, engines whose rates moved), or
        # None for a whole build
        self._log: deque[tuple[int, frozenset[str], frozenset[tuple[str, str]], frozenset[str]]
                         | tuple[int, None, None, None]] = deque(maxlen=log_versions)

    # --------------------------------------------------------------- pairs
    def add(self, entry: EngineEntry, engines: Mapping[str, EngineEntry]) -> dict[str, str]:
        """Judge every pair `entry` forms with the other registered engines; "p->d" -> "ok" or the reason."""
        verdicts = {}
        self._lost.pop(entry.engine_id, None)
        for other in engines.values():
            if other.engine_id == entry.engine_id:
                continue
            for p, d in ((entry, other), (other, entry)):
                if p.role in ("prefill", "both") and d.serves_decode:
                    problem = pair_problem(list(p.ranks.values()), list(d.ranks.values()))
                    self.problems[(p.engine_id, d.engine_id)] = problem
                    self._prefills_of.setdefault(d.engine_id, {})[p.engine_id] = problem
                    self._decodes_of.setdefault(p.engine_id, set()).add(d.engine_id)
                    verdicts[f"{p.engine_id}->{d.engine_id}"] = problem or "ok"
                    if problem:
                        logger.warning("pair %s -> %s refused: %s", p.engine_id, d.engine_id, problem)
                    else:
                        self.ledger.breaker(d.engine_id, p.engine_id)  # every routable pair has a state
        self.changed()
        return verdicts

    def drop(self, engine_id: str, lost_role: str | None = None) -> list[tuple[str, str]]:
        """Forget the engine's pairs; returns them as (decode, prefill). `lost_role`: it died (its role
        is kept in the table's `lost` until it registers again); None: it left on purpose."""
        self._rates.pop(engine_id, None)
        if lost_role is None:
            self._lost.pop(engine_id, None)
        else:
            self._lost[engine_id] = lost_role
        gone = [(d, engine_id) for d in self._decodes_of.pop(engine_id, ())]
        gone += [(engine_id, p) for p in self._prefills_of.pop(engine_id, {})]
        for d, p in gone:
            self.problems.pop((p, d), None)
            self._prefills_of.get(d, {}).pop(p, None)
            self._decodes_of.get(p, set()).discard(d)
        self.changed()
        return gone

    def left(self, engine_id: str) -> None:
        """An engine not registered (lost before) left on purpose: no longer missing."""
        if self._lost.pop(engine_id, None) is not None:
            self.changed()

    def summary(self, engine_id: str) -> dict[str, str]:
        """The verdicts of the engine's pairs, as `add` returned them."""
        out = {f"{p}->{engine_id}": v or "ok" for p, v in self._prefills_of.get(engine_id, {}).items()}
        out.update({f"{engine_id}->{d}": self.problems[(engine_id, d)] or "ok"
                    for d in self._decodes_of.get(engine_id, ())})
        return out

    def report_rates(self, engine_id: str, generation: int | None, rates: EngineRates,
                     engines: Mapping[str, EngineEntry]) -> bool:
        """An engine's report (`Coordinator.report_rates`): kept (`set_rates`) when it comes from the
        registered incarnation; False: not registered as that incarnation, ignored."""
        entry = engines.get(engine_id)
        if entry is None or (generation is not None and entry.generation != generation):
            return False
        self.set_rates(engine_id, rates)
        return True

    def set_rates(self, engine_id: str, rates: EngineRates) -> bool:
        """Keep a registered engine's own rates when they moved materially from the kept ones (the next
        table is a new version); False: nothing kept (the same numbers stand for every router)."""
        kept = self._rates.get(engine_id)
        if kept is not None and not rates.moved_from(kept):
            return False
        self._rates[engine_id] = rates
        self._rated.add(engine_id)
        self._rate_changes += 1
        return True

    def changed(self) -> None:
        """The directory changed (registration, removal, draining): the next table is a whole new one."""
        self._changes += 1
        self._whole = True

    # --------------------------------------------------------------- table
    def table(self, engines: Mapping[str, EngineEntry], settling: bool,
              hangs: Mapping[str, int] | None = None) -> RouteTable:
        """The routers' table as of now (rebuilt only when something changed since the last one);
        `hangs`: engine -> incarnations judged hung (a judgement evicts, so it comes with a change)."""
        self.ledger.advance()
        hangs = dict(hangs or {})
        key = (self._changes, self.ledger.changes, settling, sum(hangs.values()), self._rate_changes)
        if self._key is not None and key[3] != self._key[3]:
            self._whole = True  # deltas carry breakers only: new hang counts travel in a whole table
        if self._table is None or key != self._key:
            self.version += 1
            self.builds += 1
            moved = self.ledger.take_moved()
            rated, self._rated = frozenset(self._rated), set()
            if self._whole or self._table is None:
                self._whole = False
                decodes = {e.engine_id: self._usable(e.engine_id, engines) for e in engines.values()
                           if e.serves_decode and not e.draining}
                self._log.append((self.version, None, None, None))
            else:  # only breakers or rates moved: recompute the decode engines of the moved pairs
                redo = {d for d, _ in moved if d in self._table.decodes}
                decodes = {**self._table.decodes, **{d: self._usable(d, engines) for d in redo}}
                self._log.append((self.version, frozenset(redo), frozenset(moved), rated))
            self._table = RouteTable(decodes, self.ledger.pair_states(),
                                     {e.engine_id: e.generation for e in engines.values()}, settling,
                                     self.epoch, self.version, hangs,
                                     {e: r for e, r in self._rates.items() if e in engines}, dict(self._lost))
            self._key = key
        return self._table

    def since(self, epoch: str | None, version: int, engines: Mapping[str, EngineEntry],
              settling: bool, hangs: Mapping[str, int] | None = None) -> RouteTable | RouteDelta | None:
        """None when the caller's copy (`epoch`, `version`) is current; the changes since it when only
        breakers and rates moved (and the log reaches back); else the whole table."""
        table = self.table(engines, settling, hangs)
        if (epoch, version) == (table.epoch, table.version):
            return None
        if epoch != self.epoch:
            return table
        after = [entry for entry in self._log if entry[0] > version]
        if not after or after[0][0] != version + 1 or any(redo is None for _, redo, _, _ in after):
            return table
        decodes = set().union(*(redo for _, redo, _, _ in after))
        pairs = set().union(*(moved for _, _, moved, _ in after))
        rated = set().union(*(r for _, _, _, r in after))
        states = [s for s in (self.ledger.state_of(d, p) for d, p in pairs) if s is not None]
        return RouteDelta(self.epoch, version, table.version, {d: table.decodes[d] for d in decodes},
                          tuple(states), table.settling, {e: table.rates[e] for e in rated if e in table.rates})

    def _usable(self, decode_id: str, engines: Mapping[str, EngineEntry]) -> tuple[PrefillRoute, ...]:
        """Compatible prefill engines, not draining, whose breaker with `decode_id` is not open."""
        routes = []
        for p, problem in sorted(self._prefills_of.get(decode_id, {}).items()):
            if problem is not None or engines[p].draining:
                continue
            state = self.ledger.state_of(decode_id, p)
            if state is not None and (state.state == BreakerState.OPEN or state.probe_in_flight):
                continue
            routes.append(PrefillRoute(p, state.state if state is not None else BreakerState.CLOSED))
        return tuple(routes)
