"""raypd's fault counters per phase (issue 25): deadline misses, migrations, hang kills, from /metrics.

The benchmark injects no fault, so every one of these is a false alarm of the failure
machinery under load; a hang kill is the worst (a healthy engine killed with its streams).
Source: the front's `GET /metrics` (serving/ops/metrics.py), one HTTP read, the same the
placement decisions come from. It carries the coordinator's kills too: the coordinator
counts the incarnations it judged hung and killed (actors/control/liveness.py) and ships the
count with the route table, which the ingress exports as `raypd_engine_hangs_total`. The
control stats of `raypd status` do not count kills, and reading them would start a Ray driver.

A deadline miss is also the one hang suspicion a router has: each miss is reported to the
coordinator, which probes the engine (serving/routing/deadlines.py); the coordinator's own
failed sweep probes are not exported, so they are not counted here.

`FaultTrail` turns cumulative counters, read after each phase, into per-phase increases over
the life of one started set-up (its ingress and coordinator count from zero when it starts).
Everything here is pure: text and dicts in, dicts out (pd_vs_vllm.py does the reading).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class FaultCounter:
    key: str  # the name in the results file
    family: str  # the Prometheus family of the front's /metrics (samples end in _total)
    label: str  # the column of the text table


# in table order; the first four are issue 25's, the rest say what else went wrong meanwhile
COUNTERS = (
    FaultCounter("deadline_misses", "raypd_deadline_misses", "deadline misses (= hang suspicions)"),
    FaultCounter("deadline_extensions", "raypd_deadline_extensions", "extended (busy, not hung)"),
    FaultCounter("migrations", "raypd_migrations", "migrations"),
    FaultCounter("hang_kills", "raypd_engine_hangs", "hang kills"),
    FaultCounter("fallbacks", "raypd_fallbacks", "fallbacks"),
    FaultCounter("transfer_failures", "raypd_kv_transfer_failures", "KV transfer failures"),
    FaultCounter("prefill_failures", "raypd_prefill_failures", "prefill failures"),
    FaultCounter("breaker_opened", "raypd_breaker_opened", "breakers opened"),
    FaultCounter("aborts", "raypd_aborts", "aborts (client went away)"),
)
KILLS = "hang_kills"
MISSES = "deadline_misses"
# a kill follows a router's report after the coordinator's probe times out (restarts.probe_timeout_s,
# 10 s in the benchmark's configs): the last read waits this long when the last phase saw a miss
KILL_VERDICT_S = 15.0


@dataclass(frozen=True)
class Snapshot:
    """One read of the front's counters: series ("key{label=value,...}") -> cumulative value."""

    series: dict[str, float] = field(default_factory=dict)
    missing: tuple[str, ...] = ()  # counters this front does not export (an older or newer raypd)
    error: str | None = None  # the read failed: nothing else is set


def parse(metrics_text: str) -> Snapshot:
    """The fault counters of a Prometheus text exposition (labels summed per counter by `totals`)."""
    from prometheus_client.parser import text_string_to_metric_families

    by_family = {c.family: c.key for c in COUNTERS}
    series: dict[str, float] = {}
    seen: set[str] = set()
    for fam in text_string_to_metric_families(metrics_text):
        key = by_family.get(fam.name)
        if key is None:
            continue
        seen.add(key)  # exported, even when no sample is there yet (nothing happened)
        for s in fam.samples:
            if s.name.endswith("_total"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                name = f"{key}{{{labels}}}" if labels else key
                series[name] = series.get(name, 0.0) + s.value
    return Snapshot(series, tuple(c.key for c in COUNTERS if c.key not in seen))


def counter_of(series: str) -> str:
    return series.split("{", 1)[0]


def totals(series: dict[str, float], missing: Iterable[str] = ()) -> dict[str, float]:
    """Counter -> the sum over its label sets (0 for an exported counter without samples)."""
    gone = set(missing)
    out = {c.key: 0.0 for c in COUNTERS if c.key not in gone}
    for name, v in series.items():
        out[counter_of(name)] = out.get(counter_of(name), 0.0) + v
    return out


def increase(before: dict[str, float], now: dict[str, float]) -> tuple[dict[str, float], bool]:
    """Per series: what it gained since `before`; and whether some series went down (its process
    restarted and counts from zero again: its value now is what it gained, at least)."""
    out, reset = {}, False
    for name, v in now.items():
        d = v - before.get(name, 0.0)
        if d < 0:
            d, reset = v, True
        if d:
            out[name] = d
    return out, reset


class FaultTrail:
    """Per-phase increases of one started set-up's counters, into `entries` (a list of the results
    JSON, so that an aborted run keeps what was read). Reads come in phase order; several reads of
    one (round, phase) add up (the low-load phase is read after each request, by its length)."""

    def __init__(self, entries: list[dict]):
        self.entries = entries
        self._last: dict[str, float] = {}  # a new ingress and coordinator: every counter starts at 0
        self._by_key: dict[tuple[int, str], dict] = {}
        self._unread: list[str] = []  # phases whose read failed: their increase is in the next one's
        self._latest: dict | None = None  # the entry of the latest read

    def record(self, rnd: int, phase: str, snap: Snapshot) -> dict:
        """Add one read taken at the end of `phase`; returns the phase's entry."""
        e = self._by_key.get((rnd, phase))
        if e is None:
            e = {"round": rnd, "phase": phase, "reads": 0, "counts": {}, "series": {}, "missing": [],
                 "errors": [], "reset": False, "includes_unread": []}
            self._by_key[(rnd, phase)] = e
            self.entries.append(e)
        e["reads"] += 1
        self._latest = e
        if snap.error is not None:
            e["errors"].append(snap.error)
            if phase not in self._unread:
                self._unread.append(phase)
            return e
        gained, reset = increase(self._last, snap.series)
        self._last = dict(snap.series)
        for name, d in gained.items():
            e["series"][name] = e["series"].get(name, 0.0) + d
        for k, v in totals(gained, snap.missing).items():
            e["counts"][k] = e["counts"].get(k, 0.0) + v
        e["missing"] = list(snap.missing)
        e["reset"] = e["reset"] or reset
        e["includes_unread"] += [p for p in self._unread if p != phase and p not in e["includes_unread"]]
        self._unread = []
        return e

    @property
    def round(self) -> int:
        """The round of the latest read (the set-up's last phase belongs to it)."""
        return self._latest["round"] if self._latest else 0

    def last_phase_missed(self) -> bool:
        """Whether the latest phase saw a deadline miss (a kill may still be on its way)."""
        return bool(self._latest and self._latest["counts"].get(MISSES))


def per_phase(entries: list[dict]) -> dict[str, dict]:
    """Phase -> {"counts", "series", "rounds", "errors", "reset"}, summed over rounds, in run order."""
    out: dict[str, dict] = {}
    for e in entries:
        p = out.setdefault(e["phase"], {"counts": {}, "series": {}, "rounds": 0, "errors": 0, "reset": False,
                                        "missing": []})
        p["rounds"] += 1
        p["errors"] += len(e.get("errors", []))
        p["reset"] = p["reset"] or e.get("reset", False)
        p["missing"] = sorted(set(p["missing"]) | set(e.get("missing", [])))
        for where, src in (("counts", e.get("counts", {})), ("series", e.get("series", {}))):
            for k, v in src.items():
                p[where][k] = p[where].get(k, 0.0) + v
    return out


def kill_check(setup: str, entries: list[dict]) -> dict:
    """The benchmark's own check of one raypd set-up: no hang kill in any phase (no fault is
    injected). met: True / False, or None when no read succeeded (nothing to tell)."""
    read = [e for e in entries if e.get("reads", 0) > len(e.get("errors", []))]
    goal = f"no hang kill in any phase without an injected fault ({setup})"
    if not read:
        return {"goal": goal, "value": "counters never read", "met": None, "check": True}
    if all(KILLS in e.get("missing", []) for e in read):
        return {"goal": goal, "value": "the front exports no raypd_engine_hangs_total", "met": None, "check": True}
    total = {k: sum(e["counts"].get(k, 0.0) for e in read) for k in (KILLS, MISSES, "migrations")}
    where = [f"r{e['round']} {e['phase']}" for e in read if e["counts"].get(KILLS)]
    errors = sum(len(e.get("errors", [])) for e in entries)
    value = (f"{total[KILLS]:.0f} kills in {len(entries)} phases" + (f" ({', '.join(where)})" if where else "")
             + f"; {total[MISSES]:.0f} deadline misses, {total['migrations']:.0f} migrations"
             + (f"; {errors} reads failed (counted at the next read)" if errors else ""))
    return {"goal": goal, "value": value, "met": total[KILLS] == 0, "check": True}


def failed(rows: list[dict]) -> bool:
    """True when one of the benchmark's own checks failed (a non-zero exit status)."""
    return any(r.get("check") and r["met"] is False for r in rows)
