"""pd_vs_vllm.py's command line: its profiles (which set-ups, sizes and rates a run measures) and
where each profile writes its results."""

from __future__ import annotations

import argparse

_FULL = dict(lengths="128,512,2048", reps=8, rounds=2, low_max_tokens=8, rates="0.3,0.6,0.9",
             load_requests=20, load_max_tokens=64, drain_s=60.0, idle_s=10.0, settle_s=4.0,
             mix="128:0.5,512:0.3,2048:0.2", one_round_groups="C,DC,D")
PROFILES = {
    # issues 18, 19 and 30: colocated (a)/(a2)/(a'), raypd 1P+1D (b), raypd's default (e), its colocated-only (e0)
    "full": dict(_FULL, groups="A,B,E,E0,AP", setups="a,a2,ap,b,e,e0"),
    # the same + the slow (c)/(d)/(dc) anchors, one round of them
    "anchors": dict(_FULL, groups="A,B,E,E0,AP,C,DC,D", setups="a,a2,ap,b,e,e0,c,d,dc"),
    # issue 30 alone: the stack's cost, raypd never disaggregating (e0) and its default (e) against (a)/(a2)
    "stack": dict(_FULL, groups="A,E0,E", setups="a,a2,e0,e"),
    # issue 28: the shape `raypd config --plan` picks for this load (ep) against (a2) and (a')
    "plan": dict(_FULL, groups="A,AP,EP", setups="a,a2,ap,ep"),
    # issue 55: the held-out comparison's workload (512-token prompts, 64-token answers, 0.25-1 req/s):
    # raypd's default (e) against one vLLM on both cores (a'), with first->second token gaps
    "second_token": dict(_FULL, lengths="512", rates="0.25,0.5,1.0", load_requests=24, mix="512:1",
                         groups="AP,E", setups="ap,e", slo_ttft_s=3.0, slo_tpot_s=0.1),
    "quick": dict(lengths="128,512", reps=2, rounds=1, low_max_tokens=8, rates="0.3,0.8",
                  load_requests=4, load_max_tokens=16, drain_s=30.0, idle_s=3.0, settle_s=2.0,
                  mix="128:0.6,512:0.4", groups="A,B,E,E0,AP", setups="a,a2,ap,b,e,e0",
                  one_round_groups="C,DC,D"),
}
# a --quick run never overwrites a committed result (benchmarks/out/ is git-ignored)
OUTPUTS = {"full": dict(out="benchmarks/results/pd_vs_vllm.json", plot="benchmarks/results/pd_vs_vllm.png"),
           "anchors": dict(out="benchmarks/results/pd_vs_vllm_anchors.json",
                           plot="benchmarks/results/pd_vs_vllm_anchors.png"),
           "stack": dict(out="benchmarks/results/pd_vs_vllm_stack.json",
                         plot="benchmarks/results/pd_vs_vllm_stack.png"),
           "plan": dict(out="benchmarks/results/pd_vs_vllm_plan.json", plot="benchmarks/results/pd_vs_vllm_plan.png"),
           "second_token": dict(out="benchmarks/results/pd_vs_vllm_second_token.json",
                                plot="benchmarks/results/pd_vs_vllm_second_token.png"),
           "quick": dict(out="benchmarks/out/pd_vs_vllm_quick.json", plot="benchmarks/out/pd_vs_vllm_quick.png")}


def parse_args(argv: list[str] | None, description: str = "") -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", choices=sorted(PROFILES), default="full",
                   help="full: groups A,B,E,E0,AP (issues 18, 19, 30; ~49 min); anchors: + C,DC,D in round 1; "
                        "stack: A,E0,E (issue 30, ~30 min); plan: A,AP,EP (issue 28); second_token: AP,E on issue 55's "
                        "workload; quick")
    p.add_argument("--quick", action="store_true", help="= --profile quick (small sizes for development)")
    p.add_argument("--groups", default=None, help="set-up groups, in round-1 order (A, AP, B, E, E0, EP, C, DC, D)")
    p.add_argument("--setups", default=None,
                   help="which set-ups of those groups to measure (a,a2,ap,b,e,e0,ep,c,d,dc)")
    p.add_argument("--one-round-groups", default=None, help="groups that run in round 1 only (the slow anchors)")
    p.add_argument("--lengths", default=None, help="low-load prompt lengths (tokens)")
    p.add_argument("--reps", type=int, default=None, help="low-load requests per length per round")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--low-max-tokens", type=int, default=None, help="answer length at low load")
    p.add_argument("--rates", default=None, help="Poisson arrival rates (requests/s)")
    p.add_argument("--load-requests", type=int, default=None, help="requests per rate per round")
    p.add_argument("--load-max-tokens", type=int, default=None, help="answer length under load")
    p.add_argument("--mix", default=None, help="prompt length mix under load, length:weight (lengths of --lengths)")
    p.add_argument("--drain-s", type=float, default=None, help="give up on requests this long after the last arrival")
    p.add_argument("--idle-s", type=float, default=None, help="idle CPU window per group and round")
    p.add_argument("--settle-s", type=float, default=None, help="pause after warm-up before the idle window")
    p.add_argument("--slo-ttft-s", type=float, default=None, help=(
        "a fixed goodput SLO (with --slo-tpot-s), as `vllm bench serve --goodput` takes it: TTFT and mean "
        "ITL limits for every request; unset: derived from (a)'s low-load run"))
    p.add_argument("--slo-tpot-s", type=float, default=None, help="the fixed SLO's mean ITL (TPOT) limit")
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--start-timeout-s", type=float, default=420.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default=None, help="logs of every process started (default /tmp/pdbench-<time>)")
    p.add_argument("--out", default=None, help="results JSON (+ .txt table); default per profile: OUTPUTS")
    p.add_argument("--plot", default=None, help="PNG plot; default per profile: OUTPUTS")
    p.add_argument("--plan", action="store_true",
                   help="start nothing: print the schedule and its planned duration (pdbench/budget.py)")
    p.add_argument("--render", default=None, metavar="JSON",
                   help="start nothing: re-print the table (and --plot) of an earlier run's JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.profile = "quick"
    for k, v in dict(PROFILES[args.profile], **OUTPUTS[args.profile]).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if (args.slo_ttft_s is None) != (args.slo_tpot_s is None):
        p.error("--slo-ttft-s and --slo-tpot-s go together")
    lengths = {int(x) for x in args.lengths.split(",")}
    if not {int(kv.split(":")[0]) for kv in args.mix.split(",")} <= lengths:
        p.error(f"--mix lengths must be low-load lengths ({args.lengths}): the goodput SLO is per length")
    return args


def serve_llm_missing(args: argparse.Namespace) -> list[str]:
    """The packages `ray.serve.llm` imports that this environment lacks, when (d) or (dc) will run."""
    import importlib.util

    if not {"d", "dc"} & set(args.setups.split(",")) or not {"D", "DC"} & set(args.groups.split(",")):
        return []
    return [m for m in ("pyarrow", "jsonref") if importlib.util.find_spec(m) is None]
