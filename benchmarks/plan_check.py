#!/usr/bin/env python
"""The shape planner's predictions against measurement: each planned shape run with `raypd up`, side by side.

  python benchmarks/plan_check.py [--profile P | --no-measure] [--shapes "2x1 both,1P(1)+1D(1)"] [--rates 0.25,0.5,1]
                                  [--requests N] [--prompt-tokens 512] [--output-tokens 64]
                                  [--slo-ttft-s 3] [--slo-tpot-s 0.1] [--budgets plan,own,512,...]
                                  [--out benchmarks/results/plan_check.txt]

The profile is the one `raypd config --plan` would use (this host's, measured on first use; the
header names it). For every shape `raypd config --plan` considers on this box (or those named), in one run: the deployment
the planner would write (serving/sizing/deployment.py) is started with `raypd up`, and the planner's
workload is sent through its front (pdbench's open-loop client: Poisson arrivals, random token-id
prompts of the given lengths, `ignore_eos`, streamed). The prediction simulates those very requests
(their arrival times and prompt lengths), so an overloaded shape's queue grows for as long in both.
Goodput is counted as the planner counts it:
requests whose TTFT and mean time per output token after the first met both targets, per second of
offered load. Prints predicted and measured goodput per shape and rate, their ratio, and whether the
planner's choice measured best. Shapes run in the planner's order, one round (their order alternates
between runs only if you pass --shapes yourself). Each shape runs with the chunk budget the plan gave it
(`--budgets plan`, the default); `--budgets own,512,512,own` runs it once per item instead, in that order
(`own`: the deployment's own budget; a number: that budget), each predicted with that budget: a
side-by-side of budgets on the same requests.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(ROOT), str(HERE)]

from pdbench import client, planned  # noqa: E402
from serving.bench.provenance import git_state, header_line  # noqa: E402
from serving.cli.plan import MEASURE_SECONDS, parse_prompt_mix, parse_rates, profile_for  # noqa: E402
from serving.cli.scratch_up import scratch_up  # noqa: E402
from serving.config import load_config  # noqa: E402
from serving.sizing.deployment import deployment_yaml  # noqa: E402
from serving.sizing.plan import plan  # noqa: E402
from serving.sizing.workload import Request, SloTargets, Workload  # noqa: E402

VOCAB = 49152  # SmolLM2's


def measured_goodput(records: list[client.Record], count: int, rate: float, slo: SloTargets) -> tuple[float, int]:
    """(goodput, requests that failed) as the planner counts goodput: within both targets / (count / rate)."""
    good = failed = 0
    for rec in records:
        if not rec.ok or rec.ttft_s is None:
            failed += 1
            continue
        good += planned.within_targets(rec.ttft_s, rec.token_times_s, rec.completion_tokens, slo)
    failed += count - len(records)  # given up at the drain limit
    return good / (count / rate), failed


def sent_requests(args: argparse.Namespace, workload: Workload) -> dict[float, list[client.Request]]:
    """Per rate, the requests the client sends every shape (the same ones: one seed, one stream per rate)."""
    mix = dict(workload.prompt_mix)
    return {rate: client.poisson_requests(args.seed, i, rate, args.requests, mix, workload.output_tokens, VOCAB)
            for i, rate in enumerate(workload.rates)}


def as_arrivals(sent: dict[float, list[client.Request]]) -> dict[float, tuple[Request, ...]]:
    """The planner's view of the requests sent: arrival times and prompt lengths."""
    return {rate: tuple(Request(r.at_s, r.length) for r in reqs) for rate, reqs in sent.items()}


def run_shape(yaml_text: str, args: argparse.Namespace, workload: Workload, slo: SloTargets,
              model: str, sent: dict[float, list[client.Request]]) -> list[tuple[float, int]]:
    """One shape up, its load at every rate, down; (goodput, failed) per rate."""
    with scratch_up(yaml_text, 420, port=args.port) as up:
        out = []
        for rate in workload.rates:
            records, _ = asyncio.run(client.poisson(up.url, model, sent[rate], 300.0, args.drain_s))
            out.append(measured_goodput(records, args.requests, rate, slo))
        return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", default=None, help="default: this host's, as `raypd config --plan` takes it "
                                                   "(measured on first use)")
    p.add_argument("--no-measure", action="store_true", help="without a profile of this host: the shipped one")
    p.add_argument("--measure-seconds", type=float, default=MEASURE_SECONDS)
    p.add_argument("--config", default=str(ROOT / "configs" / "local.yaml"), help="the base deployment")
    p.add_argument("--shapes", default=None, help="comma-separated shape labels (default: every planned shape)")
    p.add_argument("--rates", default="0.25,0.5,1.0")
    p.add_argument("--requests", type=int, default=24, help="requests per rate (measured)")
    p.add_argument("--prompt-tokens", default="512:1.0")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--slo-ttft-s", type=float, default=3.0)
    p.add_argument("--slo-tpot-s", type=float, default=0.1)
    p.add_argument("--drain-s", type=float, default=90.0, help="give up on requests this long after the last arrival")
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--budgets", default="plan",
                   help="chunk budgets each shape runs with, in order: plan (the plan's), own (the deployment's), N")
    p.add_argument("--out", default=None, help="write the table here too (with its provenance header)")
    args = p.parse_args()

    base = load_config(args.config)
    chosen_profile = profile_for(args, base)
    profile = chosen_profile.profile
    workload = Workload(prompt_mix=parse_prompt_mix(args.prompt_tokens), output_tokens=args.output_tokens,
                        rates=parse_rates(args.rates))
    slo = SloTargets(ttft_s=args.slo_ttft_s, tpot_s=args.slo_tpot_s)
    base_data = base.model_dump(mode="json", exclude_defaults=True)
    sent = sent_requests(args, workload)
    # predicted for the very requests measured (arrivals and prompt lengths): an overloaded shape's
    # goodput depends on how long its queue had to grow, so a longer simulated run is not like for like
    planned = plan(profile, workload, slo, base_data, arrivals=as_arrivals(sent))
    wanted = {s.strip() for s in args.shapes.split(",")} if args.shapes else None
    chosen = f"{planned.chosen.shape.label} @{planned.chosen.budget_tokens}"
    load_before, t0 = os.getloadavg(), time.monotonic()
    rows, best = [], (None, -1.0)
    for planned_shape in planned.predictions:
        if wanted is not None and planned_shape.shape.label not in wanted:
            continue
        for item in (b.strip() for b in args.budgets.split(",")):
            budget = planned_shape.budget if item == "plan" else None if item == "own" else int(item)
            pred = planned_shape if item == "plan" else next(
                p for p in plan(profile, workload, slo, base_data, arrivals=as_arrivals(sent), budgets=(budget,)).predictions
                if p.shape == planned_shape.shape)
            label = f"{pred.shape.label} @{pred.budget_tokens}"
            measured = run_shape(deployment_yaml(pred.shape, base_data, profile.unit, slo, budget), args, workload, slo,
                                 base.served_model_name, sent)
            total = sum(g for g, _ in measured)
            best = max(best, (label, total), key=lambda x: x[1])
            for r, (goodput, failed) in zip(pred.results, measured):
                ratio = f"{r.goodput / goodput:.2f}" if goodput else "-"
                mark = "   <- chosen" if (pred.shape, pred.budget) == (planned.chosen.shape, planned.chosen.budget) else ""
                rows.append(f"  {label:<19} {r.rate:>6g} {r.goodput:>10.3f} {goodput:>9.3f} {ratio:>10} {failed:>7}{mark}")
                print(rows[-1], flush=True)
    lines = [
        f"# {dt.datetime.now(dt.timezone.utc).isoformat(timespec='seconds')}",
        "# command: " + " ".join(sys.argv),
        header_line(git_state(ROOT)),
        f"# host: {os.cpu_count()} CPUs, {platform.platform()}; load average before {load_before[0]:.2f}, "
        f"wall {time.monotonic() - t0:.0f} s",
        f"profile: {chosen_profile.label}",
        f"prompt tokens {args.prompt_tokens}, {args.output_tokens} output tokens; "
        f"SLO TTFT <= {slo.ttft_s:g} s, TPOT <= {slo.tpot_s:g} s; {args.requests} requests per rate, "
        "the same ones simulated (predicted) and sent through each shape's `raypd up` front (measured)",
        "  shape @budget         rate  predicted  measured  pred/meas  failed",
        *rows,
        f"planner's choice: {chosen}; best measured (goodput summed over the rates): {best[0]}",
    ]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
