"""`raypd profile`: a short measured profile of the running deployment's engines, for the shape planner.

1. A load through the front, in rounds until `--seconds` have passed (default: four half-lives of
   the engines' rate fits, `router.slo.rate_half_life_s`, since a fresh engine is slower than a warm
   one for minutes: docs/benchmarks.md): waves of long unique prompts (each engine's prefill rate),
   then of short prompts with long answers, `--batches` streams per engine (its step by batch size).
2. Every engine's own rate fit is read back (`EngineActor.load()`) and averaged per engine size
   (CPU cores or GPUs), weighted by the engines' samples.
3. The sizes measured replace theirs in `--out` (a `serving.sizing.profile` file; by default this
   host's profile, keyed by CPU model, cores and model, which `raypd config --plan` reads without
   `--profile`); the KV transfer rate is not measured (`router.slo`'s priors).
Run it once per engine size you want the planner to consider.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path

import yaml

from actors.rates import EngineRates
from serving.bench.samples import Sample, make_prompt
from serving.bench.sse import stream_request
from serving.config import DeploymentConfig
from serving.sizing.host_profile import HostKey, host_profile_path
from serving.sizing.profile import EngineProfile, ProfileError, load_profile, parse_profile


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default=None, help="the profile file to write, measured sizes replacing theirs (default: "
                   "this host's profile, which `raypd config --plan` reads: serving/sizing/host_profile.py)")
    p.add_argument("--prompt-words", type=int, default=600, help="words per long prompt (~1.2 tokens each)")
    p.add_argument("--seconds", type=float, default=None,
                   help="how long the load runs (default: four half-lives of the engines' rate fits)")
    p.add_argument("--batches", type=_batches, default=(1, 2, 4, 8),
                   help="streams per engine of the short-prompt waves, in turn (comma-separated)")
    p.add_argument("--api-key", default=None, help="Bearer key when the server requires one")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request timeout (s)")
    p.add_argument("--seed", type=int, default=0)


def _batches(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"streams per engine, comma-separated, each >= 1 (got {text!r})")
    return sizes


def engine_size(cfg: DeploymentConfig, role: str, index: int) -> int:
    """The units engine `index` of `role` runs on: CPU cores (cpu.bind, else num_cpus) or GPUs."""
    group = getattr(cfg, role)
    if group.tp_size * group.pp_size > 1 or group.resources.get("GPU"):
        return group.tp_size * group.pp_size
    if group.cpu.bind and index < len(group.cpu.bind):
        return len(_cores(group.cpu.bind[index]))
    return max(1, round(group.num_cpus))


def _cores(bind: str) -> set[int]:
    """The cores of one VLLM_CPU_OMP_THREADS_BIND entry ("0-1", "0,2", "3")."""
    cores: set[int] = set()
    for part in bind.split(","):
        lo, _, hi = part.strip().partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


def pooled(rates: list[EngineRates], cores: int) -> EngineProfile | None:
    """The sample-weighted mean of one size's engines (the prefill rate over their prefill samples);
    None when none of them prefilled."""
    rates = [r for r in rates if r.samples > 0]
    steps = sum(r.samples for r in rates)
    prefills = sum(r.prefill_samples for r in rates)
    if prefills <= 0:
        return None
    return EngineProfile(
        cores=cores,
        step_s=sum(r.step_s * r.samples for r in rates) / steps,
        step_per_stream_s=sum(r.step_per_stream_s * r.samples for r in rates) / steps,
        prefill_tokens_per_s=prefills / sum(r.prefill_s_per_token * r.prefill_samples for r in rates))


def _figure(x: float) -> float:
    return float(f"{x:.4g}")  # four significant digits: what a short measurement can tell


async def _load(url: str, model: str, engines: int, seconds: float, args: argparse.Namespace) -> list[str]:
    """The load: rounds until `seconds` have passed, at least one per batch size; returns the errors
    of the requests that failed."""
    import httpx

    rng = random.Random(args.seed)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    failed: list[str] = []
    async with httpx.AsyncClient(timeout=args.timeout) as client:
        async def one(words: int, max_tokens: int) -> None:
            body = {"model": model, "prompt": make_prompt(words, rng), "max_tokens": max_tokens,
                    "stream": True, "temperature": 0, "ignore_eos": True}
            sample = await stream_request(client, url, body, headers, False, Sample(ok=False))
            if not sample.ok:
                failed.append(sample.error or "no error text")

        start, rounds = time.monotonic(), 0
        while rounds < len(args.batches) or time.monotonic() - start < seconds:
            await asyncio.gather(*(one(args.prompt_words, 16) for _ in range(engines)))
            batch = args.batches[rounds % len(args.batches)]
            await asyncio.gather(*(one(32, 64) for _ in range(engines * batch)))
            rounds += 1
    return failed


def run(args: argparse.Namespace, cfg: DeploymentConfig, url: str) -> int:
    import ray

    from serving.cluster.engines import find_engines

    handles = find_engines(cfg.name)
    if not handles:
        print(f"raypd profile: no engines of deployment {cfg.name!r} are running (raypd up first)", file=sys.stderr)
        return 1
    seconds = args.seconds if args.seconds is not None else 4 * cfg.router.slo.rate_half_life_s
    print(f"raypd profile: {len(handles)} engine(s), a load of {seconds:.0f} s through {url}", flush=True)
    failed = asyncio.run(_load(url, cfg.served_model_name, len(handles), seconds, args))
    if failed:
        print(f"raypd profile: {len(failed)} request(s) failed, the profile would not be the engines' own; "
              f"the first: {failed[0]}", file=sys.stderr)
        return 1
    by_size: dict[int, list[EngineRates]] = {}
    for actor, handle in sorted(handles.items()):
        role, _, index = actor.removeprefix(f"raypd-{cfg.name}-").rpartition("-")
        rates = ray.get(handle.load.remote(), timeout=30).meter.rates
        if rates is not None:
            by_size.setdefault(engine_size(cfg, role, int(index)), []).append(rates)
    measured = {cores: pooled(rates, cores) for cores, rates in sorted(by_size.items())}
    for cores in [cores for cores, profile in measured.items() if profile is None]:
        print(f"raypd profile: the {cores}-unit engines measured no prefill; that size is left out", file=sys.stderr)
        del measured[cores], by_size[cores]
    if not measured:
        return 1
    gpus = int(ray.cluster_resources().get("GPU", 0))
    out = Path(args.out) if args.out else host_profile_path(HostKey.of(cfg.model))
    try:
        old = load_profile(out) if out.exists() else None
    except ProfileError as exc:
        print(f"raypd profile: {exc}", file=sys.stderr)
        return 2
    slo = cfg.router.slo
    merged = {e.cores: e for e in (old.engines if old else ())}
    merged.update(measured)
    data = {"unit": "gpu" if gpus else "cpu",
            "total_units": gpus or len(os.sched_getaffinity(0)),
            "transfer_tokens_per_s": old.transfer_tokens_per_s if old else slo.prior_transfer_tokens_per_s,
            "transfer_overhead_s": old.transfer_overhead_s if old else slo.prior_transfer_overhead_s,
            "engines": [{"cores": e.cores, "step_s": _figure(e.step_s), "step_per_stream_s": _figure(e.step_per_stream_s),
                         "prefill_tokens_per_s": _figure(e.prefill_tokens_per_s)} for _, e in sorted(merged.items())]}
    parse_profile(data, str(out))  # what is written reads back
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"# raypd profile of {cfg.model} ({cfg.name})\n" + yaml.safe_dump(data, sort_keys=False))
    for cores, rates in sorted(by_size.items()):
        e = merged[cores]
        print(f"{cores} {data['unit']} unit(s), {len(rates)} engine(s): step {e.step_s * 1e3:.1f} ms "
              f"+ {e.step_per_stream_s * 1e3:.2f} ms per stream, prefill {e.prefill_tokens_per_s:.0f} tokens/s")
    print(f"raypd profile: wrote {out}")
    return 0
