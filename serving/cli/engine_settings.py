"""What `raypd config` says about each engine group: the vLLM engine arguments its engines will run
with, on a CPU host and on a GPU host, and why each value is what it is.

The values come from the same places the engine takes them from (`DeploymentConfig.engine_config`,
`actors.engine.vllm.args.platform_defaults`), so the listing cannot drift from what runs. A value
shown as None is vLLM's own default: vLLM resolves it when the engine starts. Printed as YAML
comments after the deployment, so that the file `raypd config` writes still reads back as it is.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any

from actors.engine.config import EngineConfig
from actors.engine.vllm.args import CONNECTOR, KV_ROLES, platform_defaults
from serving.config import ROLES, DeploymentConfig

# the engine arguments whose defaults raypd may replace; shown for every group even when vLLM's stand
CHOSEN = ("max_num_batched_tokens", "max_num_seqs")
WIDTH = 100  # of a comment line


@dataclass(frozen=True)
class EngineArg:
    """One vLLM engine argument of a group's engines: its value on each platform (None: vLLM's default)."""

    name: str
    cpu: Any
    gpu: Any
    why: str


def engine_args(cfg: DeploymentConfig, role: str) -> list[EngineArg]:
    """The vLLM engine arguments `role`'s engines run with as the deployment starts them (an engine the
    autoscaler starts later may get a chunk budget from measured rates instead of the priors)."""
    ecfg = cfg.engine_config(role)
    added = {arg.name: arg for arg in _pd_args(role, ecfg)}
    written = [EngineArg(key, value, value, f"written in {_where(cfg, role, key)}")
               for key, value in ecfg.engine_kwargs.items() if key not in added]
    for key in added.keys() & ecfg.engine_kwargs.keys():  # raypd's value over the operator's: say so
        arg = added[key]
        added[key] = EngineArg(key, arg.cpu, arg.gpu, f"{arg.why} (over the value written in {_where(cfg, role, key)})")
    chosen = [_chosen(cfg, ecfg, key) for key in CHOSEN if key not in ecfg.engine_kwargs]
    return [*_fields(cfg, role, ecfg), *written, *chosen, *added.values()]


def _pd_args(role: str, ecfg: EngineConfig) -> list[EngineArg]:
    """What raypd adds for P/D and its routers (`actors.engine.vllm.args.build_engine_args`, the backend)."""
    args = []
    if ecfg.kv_connector:
        args.append(_same("kv_transfer_config", f"{CONNECTOR} as {KV_ROLES[role]}",
                          "raypd's KV connector moves the KV between engines (P/D)"))
        args.append(_same("disable_log_stats", False, "raypd reads the engine's KV usage from vLLM's stats"))
    if ecfg.kv_events:
        args.append(_same("kv_events_config", "raypd's relay",
                          "router.policy cache_aware: the engine's KV cache events feed the routers' prefix index"))
    if ecfg.tp_size * ecfg.pp_size > 1 and "distributed_executor_backend" not in ecfg.engine_kwargs:
        args.append(_same("distributed_executor_backend", "mp",
                          "the engine runs in a Ray placement group; its workers are local processes"))
    elif "distributed_executor_backend" not in ecfg.engine_kwargs:
        args.append(EngineArg("distributed_executor_backend", ecfg.cpu_engine_defaults.get("distributed_executor_backend"),
                              None, "CPU host: one rank, the model runs in vLLM's engine-core process, no worker "
                              "process beside it (actors/engine/vllm/uniproc.py); GPU host: vLLM's default"))
    if "scheduler_cls" in ecfg.cpu_engine_defaults:
        args.append(EngineArg("scheduler_cls", ecfg.cpu_engine_defaults["scheduler_cls"], None,
                              "CPU host: vLLM's scheduler, but a step where a stream is owed its second token "
                              "carries no prefill chunk (actors/engine/vllm/second_token.py); GPU host: vLLM's "
                              "async scheduler"))
    if "speculative_config" not in ecfg.engine_kwargs:
        args.append(EngineArg("logits_processors", "+ ResumedPenalties", None,
                              "CPU host: a decode engine continues a resumed request without replaying its first token"))
    return args


def engine_args_comment(cfg: DeploymentConfig) -> str:
    """YAML comment lines: each engine group's arguments, `CPU host | GPU host` where they differ."""
    if cfg.backend != "vllm":
        return "# engines: the synthetic backend (no vLLM engine arguments)\n"
    lines = ["# The vLLM engine arguments each engine will run with, and why",
             "# (\"vLLM's default\": vLLM picks the value when the engine starts, for its platform)"]
    for role in ROLES:
        group = getattr(cfg, role)
        if not group.count:
            continue
        lines.append(f"# {role}: {group.count} engine(s), tp_size {group.tp_size}, pp_size {group.pp_size}")
        for arg in engine_args(cfg, role):
            value = _shown(arg.cpu) if arg.cpu == arg.gpu else f"CPU host {_shown(arg.cpu)} | GPU host {_shown(arg.gpu)}"
            lines.append(f"#   {arg.name}: {value}")
            lines += textwrap.wrap(arg.why, WIDTH, initial_indent="#       ", subsequent_indent="#       ")
    return "\n".join(lines) + "\n"


def _fields(cfg: DeploymentConfig, role: str, ecfg: EngineConfig) -> list[EngineArg]:
    """The engine arguments raypd holds in its own fields (one value each, wherever it was written)."""
    return [
        _same("model", cfg.model, "raypd's `model` (the engine resolves it to a local folder)"),
        _same("dtype", ecfg.dtype, "raypd's `dtype`"),
        _same("max_model_len", ecfg.max_model_len, "raypd's `max_model_len`"),
        _same("tensor_parallel_size", ecfg.tp_size, f"raypd's `{role}.tp_size`"),
        _same("pipeline_parallel_size", ecfg.pp_size, f"raypd's `{role}.pp_size`"),
        _same("block_size", ecfg.block_size, f"raypd's `{role}.block_size`" if ecfg.block_size is not None
              else f"`{role}.block_size` unset: vLLM's default for the platform"),
    ]


def _chosen(cfg: DeploymentConfig, ecfg: EngineConfig, key: str) -> EngineArg:
    """An argument raypd may set where the operator wrote none: its value per platform, and why."""
    cpu, gpu = platform_defaults(ecfg, is_cpu=True).get(key), platform_defaults(ecfg, is_cpu=False).get(key)
    if key == "max_num_seqs":
        why = ("CPU host: raypd's default for prefill engines, one prompt at a time (first come, first served); "
               "GPU host: `vllm serve`'s default, prompts batched" if cpu is not None else "`vllm serve`'s default")
        return EngineArg(key, cpu, gpu, why)
    if cpu is None:
        return EngineArg(key, None, None, "vLLM's default (raypd sets a chunk budget on decode-capable engines "
                                          "under router.placement slo or colocate only)")
    slo = cfg.router.slo
    why = (f"CPU host: raypd's chunk budget, a step with a prefill chunk within router.slo.itl_target_s "
           f"{slo.itl_target_s} s at the priors ({slo.prior_prefill_tokens_per_s:g} prompt tokens/s, "
           f"{slo.prior_step_s:g} s per step); GPU host: `vllm serve`'s default for that GPU (vLLM's table)")
    if cfg.autoscaler.enabled:
        why += (". An engine the autoscaler starts gets the budget of the rates its role's engines measured "
                "(on a GPU only when above `vllm serve`'s)")
    return EngineArg(key, cpu, gpu, why)


def _same(name: str, value: Any, why: str) -> EngineArg:
    return EngineArg(name, value, value, why)


def _where(cfg: DeploymentConfig, role: str, key: str) -> str:
    return f"{role}.engine_kwargs" if key in getattr(cfg, role).engine_kwargs else "engine_kwargs"


def _shown(value: Any) -> str:
    if value is None:
        return "vLLM's default"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)
