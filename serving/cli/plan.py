"""`raypd config --plan`: the shape that maximizes goodput within the SLO targets, as a deployment.

  raypd config --plan [--profile PATH] [--slo-ttft-s S] [--slo-tpot-s S] [--rates R,R,...]
                      [--prompt-tokens TOKENS:SHARE,...] [--output-tokens N] [--plan-out PATH]
                      [--config FILE and the other deployment flags: the base deployment]

Prints the predicted goodput of every shape to stderr (serving.sizing.plan.render_table) and the
chosen deployment's YAML to stdout (or --plan-out): the base deployment (--config, else the
embedded default) with only its engine groups, router.placement (and the targets placement `slo`
judges by) and, where the plan chose one, the decode-capable engines' `max_num_batched_tokens` changed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from serving.config import DeploymentConfig
from serving.sizing.deployment import deployment_yaml
from serving.sizing.plan import plan, render_table
from serving.sizing.profile import load_profile
from serving.sizing.workload import SloTargets, Workload

DEFAULT_PROFILE = str(Path(__file__).resolve().parents[2] / "configs" / "profiles" / "smollm2-cpu.yaml")


def add_arguments(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--plan", action="store_true",
                     help="propose the engine shape with the most goodput within the SLO targets, from a profile")
    cmd.add_argument("--profile", default=DEFAULT_PROFILE, metavar="PATH",
                     help="the model's measured rates on this hardware (default: configs/profiles/smollm2-cpu.yaml)")
    cmd.add_argument("--slo-ttft-s", type=float, default=3.0, metavar="S", help="TTFT target (default 3.0)")
    cmd.add_argument("--slo-tpot-s", type=float, default=0.1, metavar="S",
                     help="target of a request's mean time per output token after the first (default 0.1)")
    cmd.add_argument("--rates", default="0.25,0.5,1.0", metavar="R,...", help="request rates, req/s (Poisson)")
    cmd.add_argument("--prompt-tokens", default="512:1.0", metavar="TOKENS:SHARE,...",
                     help="the prompt-length mix, e.g. 512:0.8,2048:0.2 (default 512:1.0)")
    cmd.add_argument("--output-tokens", type=int, default=64, metavar="N", help="output tokens per request")
    cmd.add_argument("--plan-out", default=None, metavar="PATH", help="write the chosen deployment here")


def parse_prompt_mix(text: str) -> tuple[tuple[int, float], ...]:
    """"512:0.8,2048:0.2" -> ((512, 0.8), (2048, 0.2)); a bare "512" has share 1."""
    mix = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        tokens, _, share = item.partition(":")
        try:
            mix.append((int(tokens), float(share) if share else 1.0))
        except ValueError:
            raise ValueError(f"--prompt-tokens {item!r}: expected TOKENS:SHARE (e.g. 512:0.8)") from None
    return tuple(mix)


def parse_rates(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(r) for r in text.split(",") if r.strip())
    except ValueError:
        raise ValueError(f"--rates {text!r}: expected numbers separated by commas (e.g. 0.25,0.5,1)") from None


def run_plan(args: argparse.Namespace, base: DeploymentConfig) -> int:
    try:
        profile = load_profile(args.profile)
        workload = Workload(prompt_mix=parse_prompt_mix(args.prompt_tokens), output_tokens=args.output_tokens,
                            rates=parse_rates(args.rates))
        slo = SloTargets(ttft_s=args.slo_ttft_s, tpot_s=args.slo_tpot_s)
        if workload.longest_prompt + workload.output_tokens > base.max_model_len:
            raise ValueError(f"a {workload.longest_prompt}-token prompt and {workload.output_tokens} output "
                             f"tokens exceed the deployment's max_model_len {base.max_model_len}")
        base_data = base.model_dump(mode="json", exclude_defaults=True)  # validates back to `base`
        result = plan(profile, workload, slo, base_data)
        text = deployment_yaml(result.chosen.shape, base_data, profile.unit, slo, result.chosen.budget)
    except ValueError as exc:  # ProfileError, ConfigError and a bad flag alike
        print(f"raypd config --plan: {exc}", file=sys.stderr)
        return 2
    print(render_table(result), end="", file=sys.stderr)
    budget = f" (max_num_batched_tokens {result.chosen.budget})" if result.chosen.budget else ""
    head = (f"# planned by `raypd config --plan` ({args.profile}): {result.chosen.shape.label}{budget}, predicted goodput "
            + ", ".join(f"{r.goodput:.3g} req/s at {r.rate:g}" for r in result.chosen.results) + "\n")
    if args.plan_out:
        Path(args.plan_out).write_text(head + text)
        print(f"raypd config --plan: wrote {args.plan_out}", file=sys.stderr)
    else:
        print(head + text, end="")
    return 0
