"""benchmarks/faults.py's results, from its JSON alone: each phase's figures under the near-tie rule, the
per-phase fault counters, and the benchmark's own check (raypd: no wrong answer, cut stream or hung
request). `judge_ties` loads the model (transformers) to judge mismatches; the rest is pure."""

from __future__ import annotations

from pdbench import fault_outcomes, fault_ties


def references_of(res: dict, setup: str, phase: str) -> list[str]:
    """The references a phase is judged by: the across-hosts set-up's own for the partition."""
    return res.get("phase_references", {}).get(setup, {}).get(phase) or res["references"][setup]


def fault_counts(res: dict) -> dict:
    return {s: {e["phase"]: e["counts"] for e in entries} for s, entries in res.get("fault_trail", {}).items()}


def judge_ties(res: dict, model_path: str, prompts: list[list[int]]) -> None:
    """res["tie_gaps"][setup][phase][idx]: the top-two gap at the first differing token of every
    complete answer whose text differs from its reference (pdbench/fault_ties.py)."""
    from pdbench.fault_ties import TieJudge

    judge: TieJudge | None = None
    for setup, phases in res["streams"].items():
        for phase, streams in phases.items():
            refs = references_of(res, setup, phase)
            for d in streams:
                s = fault_outcomes.Stream(**d)
                if fault_outcomes.complete(s) and s.text != refs[s.idx]:
                    judge = judge or TieJudge(model_path)
                    gap = judge.gap(prompts[s.idx], refs[s.idx], s.text)
                    res["tie_gaps"].setdefault(setup, {}).setdefault(phase, {})[str(s.idx)] = gap


def figures(res: dict) -> dict[str, dict[str, fault_outcomes.PhaseFigures]]:
    out: dict[str, dict[str, fault_outcomes.PhaseFigures]] = {}
    for setup, phases in res["streams"].items():
        for phase, streams in phases.items():
            refs = references_of(res, setup, phase)
            gaps = res.get("tie_gaps", {}).get(setup, {}).get(phase, {})
            info = res["phase_info"].get(setup, {}).get(phase, {})
            if "end_s" not in info:
                continue
            outs = [fault_outcomes.classify(s, refs[s.idx], gaps.get(str(s.idx)), fault_ties.NEAR_TIE_NATS)
                    for s in (fault_outcomes.Stream(**d) for d in streams)]
            w = fault_outcomes.Window(info["fault_s"], info["until_s"], info["end_s"])
            out.setdefault(setup, {})[phase] = fault_outcomes.aggregate(outs, w)
    return out


def finish(res: dict, raypd: set[str], stop_phases: set[str]) -> list[str]:
    """The per-phase figures, the table's summary fields and the benchmark's check (raypd only)."""
    res["fault_counts"] = fault_counts(res)
    figs = figures(res)
    res["figures"] = {s: {p: f.to_json() for p, f in ps.items()} for s, ps in figs.items()}
    check = fault_outcomes.bad_of_raypd(figs, raypd)
    for s in raypd & set(res["setups"]):
        if s in res.get("setup_errors", {}):
            check.append(f"{s}: {res['setup_errors'][s]}")
    notes = [f"{s}: {fault_outcomes.false_kills(e, stop_phases):.0f} false kills"
             for s, e in res.get("fault_trail", {}).items()]
    res["check"] = check
    res["false_kills"] = notes
    return check
