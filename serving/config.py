"""A raypd deployment (`DeploymentConfig`): engines by role, routing, transfer, breakers, restarts,
HTTP, Ray and the autoscaler. Loaded from YAML.

`DeploymentConfig.from_dict` is what the Serve builder, the CLI and the KubeRay manifests all go
through, so a bad file is refused the same way everywhere, with a message that names the field.
Each section is a model of its own (the config floor: serving/*_config.py and actors' config
modules); `engine_config` gives one engine its `EngineConfig`, which embeds the role's `EngineSpec`.

`engine_kwargs` (shared, and per role over them) go to vLLM unchanged, but for the few raypd owns,
lifted into its fields (`actors.engine.vllm.lifting`). Where the operator set none, raypd adds
engine arguments per platform (`cpu_engine_defaults`, `gpu_engine_defaults`: a CPU prefill engine's
`max_num_seqs` 1, a one-rank CPU engine's `uni` executor, the chunk budget of decode-capable engines
under SLO placement); docs/configuration.md lists them and why.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from actors.config_base import StrictModel
from actors.control.breaker_config import BreakerConfig
from actors.engine.config import (
    Backend,
    CpuHostConfig,
    DType,
    EngineConfig,
    EngineCpuConfig,
    EngineSpec,
    RateModelConfig,
    SyntheticEngineConfig,
    SyntheticModelConfig,
    SyntheticPoolConfig,
)
from actors.engine.vllm.lifting import lift_deployment_kwargs
from actors.transfer_config import TransferConfig

# serving/'s ground floor: of serving/ only the config types kept beside this file, which import
# nothing of serving/ themselves; routing and cluster import them from there (tests/unit/test_config_layers.py)
from serving.autoscaler_config import AutoscalerConfig
from serving.placement_config import ChunkBudget, MeasuredRates
from serving.router_config import RouterConfig
from serving.runtime_config import HttpConfig, RayConfig, RestartConfig

__all__ = ["ConfigError", "DeploymentConfig", "EngineGroupConfig", "HttpConfig", "RouterConfig", "check_engine_args",
           "load_config"]

ROLES = ("prefill", "decode", "both")
PREFILL_CAPABLE, DECODE_CAPABLE = ("prefill", "both"), ("decode", "both")
# vLLM engine arguments a CPU prefill engine gets unless its engine_kwargs set them: one prompt at a time,
# first come first served (vLLM would pack every queued prompt into one step, each prompt's first token
# then waiting for the whole pack)
PREFILL_DEFAULT_KWARGS: dict[str, Any] = {"max_num_seqs": 1}
# a decode-capable CPU engine: a step where a stream is owed its second token carries no prefill
# chunk (actors.engine.vllm.second_token; named, not imported: this module loads without vLLM)
DECODE_DEFAULT_KWARGS: dict[str, Any] = {"scheduler_cls": "actors.engine.vllm.second_token.SecondTokenScheduler"}


class ConfigError(ValueError):
    """A deployment file or dict is invalid; the message lists every problem."""


class GroupCpuConfig(CpuHostConfig):
    """A role's `CpuHostConfig` and the cores each of its engines is bound to."""

    bind: list[str] | None = Field(None, description=(
        "one VLLM_CPU_OMP_THREADS_BIND per engine of the role (\"0\", \"0-1\", \"0|1\" for two ranks, \"nobind\")"))


# a role's settings that moved into its `cpu:` and `synthetic:` blocks: old key -> (block, key)
MOVED_GROUP_KEYS = {"cpu_bind": ("cpu", "bind"), "compute_nice": ("cpu", "compute_nice"),
                    "shm_busy_loop_s": ("cpu", "shm_busy_loop_s"), "num_blocks": ("synthetic", "num_blocks"),
                    "layout": ("synthetic", "layout")}


class EngineGroupConfig(EngineSpec):
    """`count` engines of one role, each of the shape `EngineSpec` says (their `EngineConfig` embeds it)."""

    count: int = Field(1, ge=0, le=64, description=(
        "engines of this role (the starting size when the autoscaler runs); `both`: role-flexible engines, "
        "each can prefill for a peer, decode a peer's prefill or serve a request end to end"))
    cpu: GroupCpuConfig = GroupCpuConfig()
    synthetic: SyntheticPoolConfig = SyntheticPoolConfig()
    engine_kwargs: dict[str, Any] = Field({}, description=(
        "vLLM engine arguments of this role, over the shared `engine_kwargs`"))

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        """A file written before the `cpu:` and `synthetic:` blocks: its flat keys move into them."""
        if not isinstance(data, dict) or not MOVED_GROUP_KEYS.keys() & data.keys():
            return data
        data = dict(data)
        for old, (block, key) in MOVED_GROUP_KEYS.items():
            if old in data:
                inner = dict(data.get(block) or {})
                if key in inner:
                    raise ValueError(f"{old} and {block}.{key} both set: keep {block}.{key}")
                inner[key] = data.pop(old)
                data[block] = inner
        return data


class DeploymentConfig(StrictModel):
    """A raypd deployment: its engines by role, routing, transfer, breakers, restarts, HTTP, Ray and
    the autoscaler."""

    name: str = Field("raypd", description="the deployment's name (its Ray actors' and Serve app's)")
    backend: Backend = Field("vllm", description="`vllm`, or `synthetic` (real KV caches and NIXL transfers, no model)")
    model: str = Field("smollm2", description="vllm: `smollm2` (the embedded model), a local folder or a hub id")
    synthetic: SyntheticModelConfig = SyntheticModelConfig()
    dtype: DType = Field("auto", description=(
        "vLLM's dtype (`auto`: the model's own, as vLLM picks it for the platform)"))
    max_model_len: int = Field(2048, ge=16, description="longest prompt + answer, in tokens")
    engine_kwargs: dict[str, Any] = Field({}, description=(
        "vLLM engine arguments of every role, passed to vLLM unchanged (checked against vLLM's own)"))
    prefill: EngineGroupConfig = EngineGroupConfig()
    decode: EngineGroupConfig = EngineGroupConfig()
    both: EngineGroupConfig = EngineGroupConfig(count=0)
    router: RouterConfig = RouterConfig()
    transfer: TransferConfig = TransferConfig()
    breaker: BreakerConfig = BreakerConfig()
    restarts: RestartConfig = RestartConfig()
    http: HttpConfig = HttpConfig()
    ray: RayConfig = RayConfig()
    autoscaler: AutoscalerConfig = AutoscalerConfig()

    @model_validator(mode="before")
    @classmethod
    def _lift_owned(cls, data: Any) -> Any:
        """Role-flexible engines alone unless pools are given; owned engine arguments moved into
        raypd's fields (`actors.engine.vllm.lifting`)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        both = data.get("both")
        if isinstance(both, dict) and both.get("count", 0):
            for role in ("prefill", "decode"):
                data.setdefault(role, {"count": 0})
        return lift_deployment_kwargs(data, ROLES)

    @model_validator(mode="after")
    def _cross_field(self) -> "DeploymentConfig":
        groups = {role: getattr(self, role) for role in ROLES if getattr(self, role).count}
        if not any(r in groups for r in DECODE_CAPABLE):
            raise ValueError("at least one decode-capable engine is needed (decode.count or both.count >= 1)")
        if not any(r in groups for r in PREFILL_CAPABLE) and self.router.no_prefill_fallback == "reject":
            raise ValueError("no prefill engine and router.no_prefill_fallback=reject: nothing could be served")
        for pr in (r for r in PREFILL_CAPABLE if r in groups):
            for dr in (r for r in DECODE_CAPABLE if r in groups and r != pr):
                p, d = groups[pr], groups[dr]
                if max(p.tp_size, d.tp_size) % min(p.tp_size, d.tp_size):
                    raise ValueError(f"{pr} tp_size {p.tp_size} and {dr} tp_size {d.tp_size} must divide one another")
                pb, db = self.engine_config(pr).effective_block_size, self.engine_config(dr).effective_block_size
                if db % pb:
                    raise ValueError(f"{pr} block_size {pb} must divide {dr} block_size {db}")
        for role in ROLES:
            group = getattr(self, role)
            bounds = getattr(self.autoscaler, role, None)
            # a role with no engines is never scaled (the autoscaler scales only the roles deployed)
            if (bounds is not None and self.autoscaler.enabled and group.count
                    and not bounds.min <= group.count <= bounds.max):
                raise ValueError(f"{role}.count {group.count} must lie within autoscaler.{role} "
                                 f"min {bounds.min} .. max {bounds.max}")
            if group.cpu.bind is not None and len(group.cpu.bind) != group.count:
                raise ValueError(f"{role}.cpu.bind needs one entry per engine ({group.count})")
        for role in ROLES:
            if role not in groups and role != "decode" and role != "prefill":
                continue
            try:
                self.engine_config(role)  # surfaces per-engine rules (dcp, heads, block size)
            except ValidationError as exc:
                raise ValueError(f"{role} engines: " + "; ".join(e["msg"] for e in exc.errors())) from None
        return self

    def chunk_budget_of(self, role: str, measured: MeasuredRates | None = None) -> ChunkBudget | None:
        """vLLM's max_num_batched_tokens on `role`'s engines: the operator's, else, on decode-capable
        vLLM engines under SLO placement, one that keeps a step with a local prefill chunk within the
        ITL target at the rates the role's engines `measured` (when given), else at the placement
        model's priors (None: vLLM's default)."""
        group: EngineGroupConfig = getattr(self, role)
        kwargs = {**self.engine_kwargs, **group.engine_kwargs}
        if "max_num_batched_tokens" in kwargs:
            return ChunkBudget(int(kwargs["max_num_batched_tokens"]), "operator")
        if self.backend != "vllm" or role not in DECODE_CAPABLE or self.router.placement == "disaggregate":
            return None
        block = group.block_size or 128  # vLLM's CPU default (GPU configs set their block size)
        return self.router.slo.chunk_budget(measured, int(kwargs.get("max_num_seqs", 128)), block)

    def chunk_budget(self, role: str, measured: MeasuredRates | None = None) -> int | None:
        """`chunk_budget_of`'s tokens: the budget `role`'s engines run with on a CPU host."""
        budget = self.chunk_budget_of(role, measured)
        return budget.tokens if budget is not None else None

    def rate_model(self, measured: MeasuredRates | None = None) -> RateModelConfig:
        """How an engine fits its own rates: from `router.slo`'s priors and half-life, or, started beside
        engines of its role that `measured` theirs, from those (a new engine starts from the others)."""
        priors = self.router.slo.priors()
        if measured is not None:
            priors.update(prior_prefill_tokens_per_s=measured.prefill_tokens_per_s, prior_step_s=measured.step_s)
        return RateModelConfig(**priors)

    def engine_config(self, role: str, index: int = 0, engine_id: str | None = None,
                      measured: MeasuredRates | None = None) -> EngineConfig:
        """Engine `index` of `role`; `measured`: the rates the role's live engines measured, when it
        is started beside them (its chunk budget then comes from them, not from the priors)."""
        group: EngineGroupConfig = getattr(self, role)
        kwargs = {**self.engine_kwargs, **group.engine_kwargs}
        # applied by the engine where the operator wrote none: on a CPU host raypd's tuned values, on
        # a GPU only a measured budget above `vllm serve`'s (whose defaults stand otherwise)
        cpu_defaults: dict[str, Any] = {}
        gpu_defaults: dict[str, Any] = {}
        if self.backend == "vllm":
            role_defaults = PREFILL_DEFAULT_KWARGS if role == "prefill" else DECODE_DEFAULT_KWARGS
            cpu_defaults.update({k: v for k, v in role_defaults.items() if k not in kwargs})
        if self.backend == "vllm" and group.tp_size * group.pp_size == 1 and "distributed_executor_backend" not in kwargs:
            cpu_defaults["distributed_executor_backend"] = "uni"  # the model in the core process (uniproc.py)
        budget = self.chunk_budget_of(role, measured)
        if budget is not None and budget.source != "operator":
            cpu_defaults["max_num_batched_tokens"] = budget.tokens
            if budget.source == "measured":  # the GPU engine runs it only above `vllm serve`'s (platform_defaults)
                gpu_defaults["max_num_batched_tokens"] = budget.tokens
        return EngineConfig(
            **group.spec(), role=role, backend=self.backend, engine_id=engine_id, model=self.model,
            synthetic=SyntheticEngineConfig(**self.synthetic.model_dump(), **group.synthetic.model_dump()),
            dtype=self.dtype, max_model_len=self.max_model_len, transfer=self.transfer,
            engine_kwargs=kwargs, cpu_engine_defaults=cpu_defaults, gpu_engine_defaults=gpu_defaults,
            kv_events=self.router.policy == "cache_aware", max_restarts=self.restarts.max_restarts,
            cpu=EngineCpuConfig(**group.cpu.model_dump(exclude={"bind"}),
                                bind=group.cpu.bind[index] if group.cpu.bind and index < len(group.cpu.bind) else None),
            rates=self.rate_model(measured),
        )

    def router_config(self) -> RouterConfig:
        """`router:` with what it takes from `transfer:` and `breaker:` filled in: what a Router runs with."""
        return self.router.resolved(self.transfer, self.breaker)

    @property
    def served_model_name(self) -> str:
        """As vLLM names it: the model string, except a path (absolute, ./ or ~) gives its folder name."""
        if self.http.served_model_name:
            return self.http.served_model_name
        if self.backend == "synthetic":
            return self.synthetic.model_id
        if self.model.startswith(("/", ".", "~")):
            return Path(self.model).name or self.model
        return self.model

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "DeploymentConfig":
        try:
            return cls.model_validate(data or {})
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or '(root)'}: {e['msg']}" for e in exc.errors()
            )
            raise ConfigError(f"invalid raypd deployment: {problems}") from None


def check_engine_args(cfg: DeploymentConfig) -> list[str]:
    """Check every role's engine_kwargs against vLLM's own argument classes.

    Raises ConfigError naming the key; returns notes on what raypd will override.
    Without vLLM installed (or for the synthetic backend) there is nothing to check here.
    """
    if cfg.backend != "vllm" or not (cfg.engine_kwargs or any(getattr(cfg, r).engine_kwargs for r in ROLES)):
        return []
    from actors.engine.vllm.args import EngineArgsError, check_engine_kwargs, pd_overrides, vllm_available

    if not vllm_available():
        return []
    notes: list[str] = []
    for role in ROLES:
        ecfg = cfg.engine_config(role)
        if getattr(cfg, role).count == 0 or not ecfg.engine_kwargs:
            continue
        try:
            check_engine_kwargs(ecfg.engine_kwargs)
        except EngineArgsError as exc:
            where = f"{role}.engine_kwargs" if exc.key in getattr(cfg, role).engine_kwargs else "engine_kwargs"
            raise ConfigError(f"invalid raypd deployment: {where}.{exc}") from None
        notes += [f"{role}: {note}" for note in pd_overrides(ecfg)]
    return notes


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping a deployment file holds, as written (not validated yet)."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {path} not found") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data or {}


def load_config(path: str | Path) -> DeploymentConfig:
    return DeploymentConfig.from_dict(read_config_file(path))
