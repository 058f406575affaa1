"""`raypd config --plan`: the shape that maximizes goodput within the SLO targets, as a deployment.

  raypd config --plan [--profile PATH | --no-measure] [--measure-seconds S] [--slo-ttft-s S] [--slo-tpot-s S] [--rates R,R,...]
                      [--prompt-tokens TOKENS:SHARE,...] [--output-tokens N] [--plan-out PATH]
                      [--config FILE and the other deployment flags: the base deployment]

The profile (serving/sizing/host_profile.py): --profile when given; else this host's own (keyed by
CPU model, cores and model; written by `raypd profile` from live engines, or by the measurement
below); else, on first use, this host is measured (serving/cli/host_measure.py: a few minutes) and
the result cached; with --no-measure, or where it cannot be measured, the shipped profile of another
machine, labelled as such. The plan's first line names the source.

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
from serving.cli.host_measure import MeasureError, measurable, measure, sizes_to_measure
from serving.sizing.host_profile import ChosenProfile, HostKey, choose_profile, host_profile_path, shipped
from serving.sizing.workload import SloTargets, Workload

MEASURE_SECONDS = 120.0  # per size; a second 120 s run on a warm engine fitted steps within 3 % (configs/profiles)


def add_arguments(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--plan", action="store_true",
                     help="propose the engine shape with the most goodput within the SLO targets, from a profile")
    cmd.add_argument("--profile", default=None, metavar="PATH",
                     help="the model's measured rates on this hardware (default: this host's, measured on first use)")
    cmd.add_argument("--no-measure", action="store_true",
                     help="without a profile of this host, plan from the shipped one (another machine's) "
                          "instead of measuring this host")
    cmd.add_argument("--measure-seconds", type=float, default=MEASURE_SECONDS, metavar="S",
                     help=f"load per engine size when measuring this host (default {MEASURE_SECONDS:g})")
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


def profile_for(args: argparse.Namespace, base: DeploymentConfig) -> ChosenProfile:
    """The profile the plan uses (module docstring); ProfileError or MeasureError when it fails."""
    key = HostKey.of(base.model)
    chosen = choose_profile(args.profile, key)
    if chosen is not None:
        return chosen
    why_not = "--no-measure" if args.no_measure else measurable(base)
    if why_not is not None:
        print(f"raypd config --plan: no profile of this host ({key.slug}); not measured ({why_not})",
              file=sys.stderr)
        return shipped()
    sizes = sizes_to_measure(key.cores)
    print(f"raypd config --plan: no profile of this host yet ({key.slug}): measuring it once, {len(sizes)} "
          f"engine size(s), about {len(sizes) * (args.measure_seconds + 90) / 60:.0f} min "
          "(--no-measure: plan from the shipped profile instead)", file=sys.stderr, flush=True)
    measure(base, host_profile_path(key), args.measure_seconds)
    return choose_profile(None, key) or shipped()


def run_plan(args: argparse.Namespace, base: DeploymentConfig) -> int:
    try:
        workload = Workload(prompt_mix=parse_prompt_mix(args.prompt_tokens), output_tokens=args.output_tokens,
                            rates=parse_rates(args.rates))
        slo = SloTargets(ttft_s=args.slo_ttft_s, tpot_s=args.slo_tpot_s)
        if workload.longest_prompt + workload.output_tokens > base.max_model_len:
            raise ValueError(f"a {workload.longest_prompt}-token prompt and {workload.output_tokens} output "
                             f"tokens exceed the deployment's max_model_len {base.max_model_len}")
        chosen = profile_for(args, base)  # after the flags: a typo never costs a measurement
        profile = chosen.profile
        base_data = base.model_dump(mode="json", exclude_defaults=True)  # validates back to `base`
        result = plan(profile, workload, slo, base_data)
        text = deployment_yaml(result.chosen.shape, base_data, profile.unit, slo, result.chosen.budget)
    except (ValueError, MeasureError) as exc:  # ProfileError, ConfigError and a bad flag alike
        print(f"raypd config --plan: {exc}", file=sys.stderr)
        return 2
    print(f"profile: {chosen.label}", file=sys.stderr)
    print(render_table(result), end="", file=sys.stderr)
    budget = f" (max_num_batched_tokens {result.chosen.budget})" if result.chosen.budget else ""
    head = (f"# planned by `raypd config --plan` from {chosen.label}\n# {result.chosen.shape.label}{budget}, "
            "predicted goodput " + ", ".join(f"{r.goodput:.3g} req/s at {r.rate:g}" for r in result.chosen.results) + "\n")
    if args.plan_out:
        Path(args.plan_out).write_text(head + text)
        print(f"raypd config --plan: wrote {args.plan_out}", file=sys.stderr)
    else:
        print(head + text, end="")
    return 0
