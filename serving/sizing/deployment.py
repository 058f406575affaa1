"""A shape as raypd's deployment: the config `raypd up` runs, and the step limits its engines get.

`deployment_config` / `deployment_yaml` turn a shape into a validated deployment from a base
mapping; `shape_limits` is what a step may carry on each role's engines (for the simulation);
`budget_choices` the chunk budgets the planner tries; `core_ranges` one VLLM_CPU_OMP_THREADS_BIND
per engine. Invariants: only the engine groups, the placement (colocated shapes `slo`, P/D shapes
`disaggregate`), a too-small `ray.num_cpus` and, with a budget, the decode-capable groups'
`max_num_batched_tokens` change; everything else stays as the base says; the plan's SLO targets are
given to placement `slo`, but a target the base's `router.slo` sets stays the operator's.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import yaml

from serving.config import DECODE_CAPABLE, ROLES, DeploymentConfig
from serving.placement_config import vllm_default_budget
from serving.sizing.profile import Unit
from serving.sizing.shapes import Shape
from serving.sizing.simulate import ShapeLimits, StepLimits
from serving.sizing.workload import SloTargets


def _sizes_by_role(shape: Shape) -> dict[str, tuple[int, ...]]:
    return {"prefill": shape.prefill, "decode": shape.decode, "both": shape.colocated}


def core_ranges(sizes: list[int]) -> list[str]:
    """"0-1", "2", "3": engine i gets the next sizes[i] cores, from core 0 up."""
    ranges, at = [], 0
    for k in sizes:
        ranges.append(str(at) if k == 1 else f"{at}-{at + k - 1}")
        at += k
    return ranges


def slo_targets(slo: SloTargets) -> dict[str, float]:
    """`router.slo` settings that make the placement model judge requests by the user's targets: an
    absolute TTFT target (no slowdown allowance for long prompts) and the TPOT as the mean-ITL budget."""
    return {"ttft_target_s": slo.ttft_s, "ttft_slowdown": 0.0, "itl_target_mean_s": slo.tpot_s}


def deployment_config(shape: Shape, base: Mapping[str, Any], unit: Unit,
                      slo: SloTargets | None = None, budget: int | None = None) -> DeploymentConfig:
    """`base` reshaped to `shape` (with `slo`: placement `slo` told the targets, unless the base sets
    them; with `budget`: the chunk budget of its decode-capable engines, `budget_choices`' values);
    ConfigError when raypd refuses the result (e.g. GPU tensor-parallel sizes of the two roles
    that do not divide one another, an autoscaler's bounds the counts leave)."""
    data: dict[str, Any] = copy.deepcopy(dict(base))
    by_role = _sizes_by_role(shape)
    binds = iter(core_ranges([k for role in ROLES for k in by_role[role]]))
    for role in ROLES:
        sizes = by_role[role]
        group = dict(data.get(role) or {})
        group.pop("cpu_bind", None)  # a file written before the `cpu:` block
        cpu = {k: v for k, v in (group.pop("cpu", None) or {}).items() if k != "bind"}
        group["count"] = len(sizes)
        if sizes and unit == "cpu":
            group["num_cpus"] = sizes[0]  # the Ray CPUs the engine reserves: its cores
            cpu["bind"] = [next(binds) for _ in sizes]
            group.pop("tp_size", None)  # one rank per engine, on all its cores
        elif sizes:
            group["tp_size"] = sizes[0]
        if sizes and budget is not None and role in DECODE_CAPABLE:
            group["engine_kwargs"] = {**(group.get("engine_kwargs") or {}), "max_num_batched_tokens": budget}
        if cpu:
            group["cpu"] = cpu
        data[role] = group
    router = {**(data.get("router") or {}), "placement": "slo" if shape.is_colocated else "disaggregate"}
    if slo is not None:
        router["slo"] = {**slo_targets(slo), **(router.get("slo") or {})}
    data["router"] = router
    ray = dict(data.get("ray") or {})
    if unit == "cpu" and ray.get("num_cpus") is not None and ray["num_cpus"] < shape.units:
        ray["num_cpus"] = shape.units  # a local cluster too small for the engines would never start them
        data["ray"] = ray
    return DeploymentConfig.from_dict(data)


def deployment_yaml(shape: Shape, base: Mapping[str, Any], unit: Unit, slo: SloTargets | None = None,
                    budget: int | None = None) -> str:
    """`deployment_config` as YAML: what differs from raypd's defaults (name, backend, model and the
    engine count of each role that has engines always), `raypd up --config` reads it back."""
    cfg = deployment_config(shape, base, unit, slo, budget)
    data = {"name": cfg.name, "backend": cfg.backend, "model": cfg.model,
            **cfg.model_dump(mode="json", exclude_defaults=True)}
    for role, sizes in _sizes_by_role(shape).items():
        if sizes:  # a role that has engines says how many, default or not
            data[role] = {"count": len(sizes), **data.get(role, {})}
    return yaml.safe_dump(data, sort_keys=False)


def shape_limits(cfg: DeploymentConfig, unit: Unit) -> ShapeLimits:
    """Each role's step limits as its engines would run them: the operator's engine arguments, else
    the defaults raypd applies on that platform (a CPU prefill engine: one prompt at a time; a
    decode-capable CPU engine under placement `slo`: the chunk budget from the placement priors),
    else vLLM's own budget and no cap on the requests."""

    def of(role: str) -> StepLimits:
        engine = cfg.engine_config(role)
        defaults = engine.cpu_engine_defaults if unit == "cpu" else engine.gpu_engine_defaults
        kwargs = {**defaults, **engine.engine_kwargs}
        budget = kwargs.get("max_num_batched_tokens") or vllm_default_budget(kwargs)
        seqs = kwargs.get("max_num_seqs")
        return StepLimits(budget_tokens=int(budget), max_seqs=int(seqs) if seqs else None)

    return ShapeLimits(both=of("both"), prefill=of("prefill"), decode=of("decode"))


def budget_choices(cfg: DeploymentConfig, unit: Unit) -> tuple[int | None, ...]:
    """The chunk budgets (vLLM's max_num_batched_tokens) the planner tries on `cfg`'s decode-capable
    engines: None first (what `cfg` runs: the operator's, else raypd's or vLLM's default), then, on a
    CPU box, every block-size doubling from the smallest budget vLLM accepts up to vLLM's own default
    (128, 256, ... 2048 at block size 128). Only None where the operator wrote a budget for a
    decode-capable role (theirs stands), and on a GPU box: the profile's linear step model does not
    know what a larger batch gains there, and no GPU engine runs below vLLM's default (issue 28)."""
    roles = [r for r in DECODE_CAPABLE if getattr(cfg, r).count]
    written = any("max_num_batched_tokens" in {**cfg.engine_kwargs, **getattr(cfg, r).engine_kwargs} for r in roles)
    if unit != "cpu" or written or not roles:
        return (None,)
    tops, floors = [], []
    for role in roles:
        kwargs = {**cfg.engine_kwargs, **getattr(cfg, role).engine_kwargs}
        block = getattr(cfg, role).block_size or 128  # vLLM's CPU default
        tops.append(vllm_default_budget(kwargs))
        floors.append((max(int(kwargs.get("max_num_seqs", 128)), block), block))
    floor, block = max(floors)
    choices, tokens = [], -(-floor // block) * block  # whole blocks: each chunk ends on a block boundary
    while tokens <= min(tops):
        choices.append(tokens)
        tokens *= 2
    return (None, *choices)
