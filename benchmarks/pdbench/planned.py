"""Set-up (ep)'s deployment: the shape `raypd config --plan` picks for this benchmark's load (issue 28).

(ep) asks whether the shape the planner picks on this box serves at least the goodput of the better
of (a2) and (a'). Its deployment is written at start by the command a user runs, on (e)'s file:

  raypd config --config <(e)'s file> --plan --rates <--rates> --prompt-tokens <--mix>
               --output-tokens <--load-max-tokens> --plan-out <run dir>/ep-config.yaml

with the shipped profile and the planner's default targets (TTFT <= 3 s, TPOT <= 0.1 s). The planner
also predicts (ep)'s goodput for the benchmark's very requests (each round's arrivals and prompt
lengths; an overloaded shape's queue grows for as long in both), by its own count: requests within
both targets per second of offered load. The summary sets the goodput measured by that count beside it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from serving.cli.plan import parse_prompt_mix
from serving.config import load_config
from serving.sizing.host_profile import HostKey, choose_profile, shipped
from serving.sizing.plan import plan
from serving.sizing.workload import Request, SloTargets, Workload

ROOT = Path(__file__).resolve().parents[2]
SLO = SloTargets(ttft_s=3.0, tpot_s=0.1)  # `raypd config --plan`'s defaults


def write_config(base: Path, out: Path, rates: str, mix: str, output_tokens: int) -> str:
    """Runs the user's `raypd config --plan` into `out`; its predicted-goodput table (stderr)."""
    cmd = [sys.executable, "-m", "serving.cli", "config", "--config", str(base), "--plan", "--rates", rates,
           "--prompt-tokens", mix, "--output-tokens", str(output_tokens), "--plan-out", str(out),
           "--no-measure"]  # this host's profile if one was measured, else the shipped one: never a measurement mid-benchmark
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"raypd config --plan failed ({done.returncode}): {done.stderr[-2000:]}")
    return "\n".join(ln for ln in done.stderr.splitlines() if not ln.startswith("Triton"))


def predicted(base: Path, streams: dict[tuple[int, float], list], mix: str, output_tokens: int) -> dict:
    """The planner's choice and, per rate, its goodput predicted for the benchmark's requests (mean over
    the rounds) as deployed (the shape and chunk budget `raypd config --plan` writes for the workload):
    {"shape": label, "budget": max_num_batched_tokens, "per_rate": {str(rate): req/s}} (keys as the results JSON keeps them). `streams`: (round, rate) -> client.Request."""
    rates = sorted({rate for _, rate in streams})
    workload = Workload(prompt_mix=parse_prompt_mix(mix), output_tokens=output_tokens, rates=tuple(rates))
    cfg = load_config(str(base))
    profile = (choose_profile(None, HostKey.of(cfg.model)) or shipped()).profile  # the one `write_config` used
    data = cfg.model_dump(mode="json", exclude_defaults=True)
    deployed = plan(profile, workload, SLO, data).chosen  # what `write_config`'s command writes: shape and budget
    sums: dict[float, list[float]] = {rate: [] for rate in rates}
    for rnd in sorted({r for r, _ in streams}):
        arrivals = {rate: tuple(Request(q.at_s, q.length) for q in streams[(rnd, rate)]) for rate in rates}
        result = plan(profile, workload, SLO, data, arrivals=arrivals, budgets=(deployed.budget,))
        chosen = next(p for p in result.predictions if p.shape == deployed.shape)
        for r in chosen.results:
            sums[r.rate].append(r.goodput)
    return {"shape": deployed.shape.label, "budget": deployed.budget_tokens,
            "per_rate": {str(rate): sum(g) / len(g) for rate, g in sums.items() if g}}


def within_targets(ttft_s: float | None, token_times_s: list[float], completion_tokens: int | None,
                   slo: SloTargets = SLO) -> bool:
    """The planner's count of one answered request: TTFT and mean time per output token after the first."""
    if ttft_s is None:
        return False
    n = completion_tokens or len(token_times_s)
    tpot = (token_times_s[-1] - ttft_s) / (n - 1) if n > 1 and token_times_s else 0.0
    return ttft_s <= slo.ttft_s and tpot <= slo.tpot_s


def measured(runs: list[dict], rate: float, sent_per_run: int) -> float:
    """Goodput by the planner's count over `runs` (one per round at `rate`, `sent_per_run` requests
    each, answered or not): requests within both targets per second of offered load (sent / rate)."""
    recs = [r for run in runs for r in run["records"]]
    sent = sent_per_run * len(runs)
    good = sum(within_targets(r["ttft_s"], r["token_times_s"], r.get("completion_tokens")) for r in recs if r["ok"])
    return good / (sent / rate) if sent else float("nan")
