"""A deployment from command-line flags: `raypd up --model ...`, `raypd config --model ...`.

  --model PATH_OR_ID            a local model folder, a hub id, or smollm2 (the embedded model)
  --both N                      N role-flexible engines (the default without role counts: 2)
  --prefill N --decode M        fixed pools: engines per role
  --prefill-tp X --decode-tp Y  tensor parallel size per role
  --engine-arg KEY=VALUE        a vLLM engine argument for both roles (repeatable);
  --prefill-engine-arg / --decode-engine-arg   the same for one role

Values are read as YAML scalars/flow collections (`64`, `false`, `0.9`,
`'{"mode": 0}'`), keys in vLLM's spelling (`max_num_seqs` or `max-num-seqs`).
Without `--config` the flags build a deployment from raypd's defaults (vLLM's
defaults for the engines); with `--config` they override that file. On a
CPU-only vLLM build a generated deployment also gets what the CPU needs and a
YAML file would say: one range of cores per engine rank (VLLM_CPU_OMP_THREADS_BIND)
and a Ray CPU count that fits the engines.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
from pathlib import Path
from typing import Any

import yaml

from serving.cli.engine_settings import engine_args_comment
from serving.config import ROLES, ConfigError, DeploymentConfig

DEPLOYMENT_FLAGS = ("model", "prefill", "decode", "prefill_tp", "decode_tp", "engine_arg", "prefill_engine_arg",
                    "decode_engine_arg")


DEFAULT_ENGINES = 2


def add_arguments(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--model", default=None, help="a local model folder, a hub id (org/name) or smollm2")
    for role in ROLES:
        cmd.add_argument(f"--{role}", type=int, default=None, metavar="N", help=f"number of {role} engines")
        cmd.add_argument(f"--{role}-tp", type=int, default=None, metavar="TP",
                         help=f"tensor parallel size of each {role} engine")
    cmd.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                     help="a vLLM engine argument for every engine (repeatable), e.g. max_num_seqs=64")
    for role in ROLES:
        cmd.add_argument(f"--{role}-engine-arg", action="append", default=[], metavar="KEY=VALUE",
                         help=f"a vLLM engine argument for the {role} engines only (repeatable)")


def uses_flags(args: argparse.Namespace) -> bool:
    return any(getattr(args, name, None) not in (None, []) for name in DEPLOYMENT_FLAGS)


def parse_engine_args(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        key = key.strip().lstrip("-").replace("-", "_")
        if not sep or not key:
            raise ConfigError(f"--engine-arg {item!r}: expected KEY=VALUE (e.g. max_num_seqs=64)")
        try:
            out[key] = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError:
            out[key] = raw  # not YAML: the string as given
    return out


def cpu_only_vllm() -> bool:
    """True when the installed vLLM is the CPU build (vllm-cpu)."""
    try:
        importlib.metadata.distribution("vllm-cpu")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def cpu_binds(ranks: list[int], cores: list[int]) -> list[str]:
    """VLLM_CPU_OMP_THREADS_BIND per engine: `ranks[i]` ranks each; cores shared out evenly, ranks joined by '|'.

    With more ranks than cores, ranks share cores (round robin).
    """
    total = sum(ranks)
    per_rank = max(1, len(cores) // max(total, 1))
    binds, next_rank = [], 0
    for n in ranks:
        parts = []
        for _ in range(n):
            start = (next_rank * per_rank) % len(cores)
            chunk = cores[start:start + per_rank]
            parts.append(str(chunk[0]) if len(chunk) == 1 else f"{chunk[0]}-{chunk[-1]}")
            next_rank += 1
        binds.append("|".join(parts))
    return binds


def _model_spec(model: str) -> str:
    path = Path(model).expanduser()
    return str(path.resolve()) if path.is_dir() else model  # a folder: absolute, as the engines' cwd differs


def deployment_from_flags(args: argparse.Namespace, base: dict[str, Any] | None) -> DeploymentConfig:
    """`base` (a config file's dict) with the flags applied; None: a deployment built from the flags."""
    generated = base is None
    data: dict[str, Any] = {"name": "raypd"} if generated else dict(base)
    if args.model:
        data["model"] = _model_spec(args.model)
    def asked(role: str) -> bool:
        return any(getattr(args, f) not in (None, []) for f in (role, f"{role}_tp", f"{role}_engine_arg"))

    if generated and not any(asked(role) for role in ROLES):
        data["both"] = {"count": DEFAULT_ENGINES}  # no pools asked for: role-flexible engines, placed per request
    for role in ROLES:
        if role not in data and not asked(role):
            continue
        group = dict(data.get(role) or {})
        if getattr(args, role) is not None:
            group["count"] = getattr(args, role)
        if getattr(args, f"{role}_tp") is not None:
            group["tp_size"] = getattr(args, f"{role}_tp")
        role_args = parse_engine_args(getattr(args, f"{role}_engine_arg") or [])
        if role_args:
            group["engine_kwargs"] = {**(group.get("engine_kwargs") or {}), **role_args}
        data[role] = group
    shared = parse_engine_args(args.engine_arg or [])
    if shared:
        data["engine_kwargs"] = {**(data.get("engine_kwargs") or {}), **shared}
    cfg = DeploymentConfig.from_dict(data)
    joining = bool(getattr(args, "address", None) or cfg.ray.address)
    if generated and cfg.backend == "vllm" and cpu_only_vllm() and not joining:
        cfg = _for_this_cpu(cfg)
    return cfg


def _for_this_cpu(cfg: DeploymentConfig) -> DeploymentConfig:
    """Bind each engine rank to its own cores of this host, and give Ray enough CPUs for the engines."""
    cores = sorted(os.sched_getaffinity(0))
    groups = [getattr(cfg, role) for role in ROLES]
    ranks = [g.tp_size * g.pp_size for g in groups for _ in range(g.count)]
    binds = cpu_binds(ranks, cores)
    data = cfg.model_dump(mode="json", exclude_defaults=True)
    at = 0
    for role, group in zip(ROLES, groups):
        if group.count:
            data.setdefault(role, {}).setdefault("cpu", {})["bind"] = binds[at:at + group.count]
        at += group.count
    engines_cpus = sum(g.num_cpus * g.count for g in groups)
    if cfg.ray.num_cpus is None and engines_cpus > len(cores):
        data.setdefault("ray", {})["num_cpus"] = int(engines_cpus + 0.999)
    return DeploymentConfig.from_dict(data)


def config_yaml(cfg: DeploymentConfig) -> str:
    """The YAML of `cfg` (what differs from the defaults), then, as comments, the vLLM engine arguments
    each engine group runs with and why; `raypd up --config` on it gives `cfg` back."""
    head = "# raypd deployment (`raypd up --config THIS_FILE`); fields left out take raypd's defaults\n"
    data = {"name": cfg.name, "backend": cfg.backend, "model": cfg.model,  # always said, first
            **cfg.model_dump(mode="json", exclude_defaults=True)}
    return head + yaml.safe_dump(data, sort_keys=False) + "\n" + engine_args_comment(cfg)
