"""Two sections of a pd_vs_vllm table: issue 30's goals ((e0) against (a2)) and raypd's fault
counters per phase, with the benchmark's own check (no hang kill without an injected fault)."""

from __future__ import annotations

from pdbench import faults, goals
from pdbench.summary import NAMES, RAYPD

MAIN = ("deadline_misses", "deadline_extensions", "migrations", "hang_kills")  # their own columns


def sections(sm: dict) -> list[str]:
    return _goals30(sm) + _faults(sm)


def verdict(row: dict) -> str:
    """A check (`faults.kill_check`) fails the run: FAILED, not MISSED."""
    return "FAILED" if row.get("check") and row["met"] is False else goals.verdict(row["met"])


def _rows(title: str, rows: list[dict]) -> list[str]:
    if not rows:
        return []
    width = max(len(r["goal"]) for r in rows)
    return ["", title] + [f"  {r['goal']:<{width}}  {r['value']:<44} {verdict(r)}" for r in rows]


def _goals30(sm: dict) -> list[str]:
    return _rows("ISSUE 30 GOALS (the stack's cost: raypd never disaggregating (e0) against (a2) on the same 2 cores; "
                 "CPU per token pooled over the load phases, the per-process split is in CPU PER STREAMED TOKEN):",
                 sm.get("goals30") or [])


def _faults(sm: dict) -> list[str]:
    per = sm.get("faults") or {}
    if not per and not sm.get("checks"):
        return []
    labels = {c.key: c.label for c in faults.COUNTERS}
    out = ["", "FAULT COUNTERS per phase (the front's /metrics, read at the start and after each phase; at low "
           "load after each request, by its prompt length; summed over rounds; no fault is injected, so every "
           "count is a false alarm): " + ", ".join(labels[k] for k in MAIN)]
    for s in RAYPD:
        phases = per.get(s)
        if not phases:
            continue
        out.append(f"  {NAMES[s]}")
        out.append(f"    {'phase':<22} {'misses':>7} {'extended':>9} {'migrations':>11} {'kills':>6}  other")
        for phase, p in phases.items():
            c = p["counts"]
            cell = lambda k: "-" if k in p["missing"] else f"{c.get(k, 0):.0f}"  # noqa: E731
            other = [f"{labels[k]} {v:.0f}" for k, v in c.items() if k not in MAIN and v]
            if p["errors"]:
                other.append(f"{p['errors']} reads failed")
            if p["reset"]:
                other.append("a counter restarted from 0")
            out.append(f"    {phase:<22} {cell('deadline_misses'):>7} {cell('deadline_extensions'):>9} "
                       f"{cell('migrations'):>11} {cell('hang_kills'):>6}  {', '.join(other)}")
            worst = [f"{k} {v:.0f}" for k, v in p["series"].items()
                     if faults.counter_of(k) in ("hang_kills", "deadline_misses") and v]
            if worst:
                out.append(f"    {'':<22} {'; '.join(worst)}")
    return out + _rows("CHECK (the benchmark's own: a failed check makes its exit status non-zero):",
                       sm.get("checks") or [])
