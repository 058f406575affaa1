"""The planned duration of a pd_vs_vllm run, printed before it starts (and kept in the results).

A model of this 2-core box, from earlier runs (benchmarks/README.md "Time"): a group's
start-up, its warm-up and idle window, the low-load requests one at a time (a prompt's
prefill at ~330 tokens/s on one core, then one decode step per answer token), and each
load phase: its last arrival (known exactly: the streams are drawn before the run) plus
the time the backlog takes to clear, capped by --drain-s. (c) and (d) compute at about
half speed (vLLM's NixlConnector thread shares their engine's core). Good to ~15 %.
"""

from __future__ import annotations

START_S = {"A": 30.0, "AP": 30.0, "B": 60.0, "E": 60.0, "E0": 60.0, "EP": 70.0, "C": 60.0, "D": 100.0, "DC": 70.0}
STOP_S = {"A": 5.0, "AP": 4.0, "B": 20.0, "E": 20.0, "E0": 20.0, "EP": 20.0, "C": 8.0, "D": 25.0, "DC": 20.0}
RAYPD_GROUPS = ("B", "E", "E0", "EP")  # + the bare idle actors' start and stop
SPEED = {"c": 2.2, "d": 2.4, "ap": 0.6, "ep": 0.6}  # compute time against one plain vLLM engine on one core
PREFILL_TOKENS_PER_S = 330.0
STEP_S = 0.055
FIXED_TTFT_S = 0.04
WARM_UP_S = 8.0  # 3 short requests per endpoint, the pinning
CORES = 2.0


def prefill_s(n: int) -> float:
    return FIXED_TTFT_S + n / PREFILL_TOKENS_PER_S


def low_load_s(setup: str, lengths: list[int], reps: int, max_tokens: int) -> float:
    per = sum(prefill_s(n) + max_tokens * STEP_S for n in lengths)
    return reps * per * SPEED.get(setup, 1.0)


def load_phase_s(setup: str, arrivals: list[float], lengths: list[int], max_tokens: int, drain_s: float) -> float:
    """Last arrival + the backlog left then: the work of all requests (prefill on one core each,
    decode steps shared by ~4 streams) over the 2 cores, less what the arrival span absorbed."""
    last = arrivals[-1] if arrivals else 0.0
    work = sum(prefill_s(n) + max_tokens * STEP_S / 4 for n in lengths) * SPEED.get(setup, 1.0)
    backlog = max(0.0, work / CORES - last)
    tail = max_tokens * STEP_S * 1.2 + prefill_s(lengths[-1] if lengths else 0)  # the last request's own time
    return last + min(drain_s, backlog + tail)


def plan(schedule: list[tuple[int, str]], low_setup: dict, load_setup: dict, setups: set[str], *,
         lengths: list[int], reps: int, low_max_tokens: int, streams: dict[tuple[int, float], list],
         load_max_tokens: int, drain_s: float, settle_s: float, idle_s: float) -> dict:
    """Seconds per part: {"start", "low", "load", "other", "total"}; `streams` = the load requests
    per (round, rate) (client.Request: at_s, length)."""
    parts = {"start": 0.0, "low": 0.0, "load": 0.0, "other": 0.0}
    prev = None
    for rnd, key in schedule:
        if key != prev:
            parts["start"] += START_S.get(key, 60.0) + (STOP_S.get(prev, 10.0) if prev else 0.0)
        prev = key
        parts["other"] += WARM_UP_S + settle_s + idle_s + (5.0 if key in RAYPD_GROUPS else 0.0)
        s = low_setup.get(key)
        if s in setups:
            parts["low"] += low_load_s(s, lengths, reps, low_max_tokens)
        s = load_setup.get(key)
        if s in setups:
            for (r, _rate), reqs in streams.items():
                if r == rnd:
                    parts["load"] += load_phase_s(s, [q.at_s for q in reqs], [q.length for q in reqs],
                                                  load_max_tokens, drain_s)
    if prev:
        parts["start"] += STOP_S.get(prev, 10.0)
    parts["total"] = sum(parts.values())
    return parts
