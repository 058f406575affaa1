"""The run order of a pd_vs_vllm run and its planned duration (printed before it starts; --plan).

Which set-up each group measures at low load and under load is here too: the run and its
plan read the same maps.
"""

from __future__ import annotations

import argparse

from pdbench import budget, client

# group -> the set-up it measures at low load / under load (group A: (a) alone, then (a2) behind the balancer)
LOW_SETUP = {"A": "a", "AP": "ap", "B": "b", "E": "e", "E0": "e0", "EP": "ep", "C": "c", "D": "d", "DC": "dc"}
LOAD_SETUP = {"A": "a2", "AP": "ap", "B": "b", "E": "e", "E0": "e0", "EP": "ep", "C": "c", "D": "d"}


def make_schedule(args: argparse.Namespace) -> list[tuple[int, str]]:
    """(round, group) in run order: --groups, reversed every other round; the groups of
    --one-round-groups only in round 1."""
    groups = [g for g in args.groups.split(",") if g]
    once = {g for g in (args.one_round_groups or "").split(",") if g}
    return [(r, g) for r in range(1, args.rounds + 1) for g in (groups if r % 2 else list(reversed(groups)))
            if r == 1 or g not in once]


def plan(args: argparse.Namespace, schedule: list[tuple[int, str]], vocab: int) -> dict:
    """The planned seconds per part (pdbench.budget) of this schedule; the load streams are the
    run's own (their arrival times do not depend on `vocab`, only their prompts' tokens do)."""
    lengths = [int(x) for x in args.lengths.split(",")]
    rates = [float(x) for x in args.rates.split(",")]
    mix = {int(k): float(v) for k, v in (kv.split(":") for kv in args.mix.split(","))}
    streams = {(rnd, rate): client.poisson_requests(args.seed, rnd, rate, args.load_requests, mix,
                                                    args.load_max_tokens, vocab)
               for rnd in range(1, args.rounds + 1) for rate in rates}
    return budget.plan(schedule, LOW_SETUP, LOAD_SETUP, set(args.setups.split(",")), lengths=lengths, reps=args.reps,
                       low_max_tokens=args.low_max_tokens, streams=streams, load_max_tokens=args.load_max_tokens,
                       drain_s=args.drain_s, settle_s=args.settle_s, idle_s=args.idle_s)


def plan_line(p: dict, schedule: list[tuple[int, str]]) -> str:
    return (f"planned: {p['total'] / 60:.0f} min ({p['start'] / 60:.1f} start/stop, {p['low'] / 60:.1f} low load, "
            f"{p['load'] / 60:.1f} load, {p['other'] / 60:.1f} warm-up/idle) for {' '.join(g for _, g in schedule)}")
