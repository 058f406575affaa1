"""A raypd deployment: engines, routing, transfer, breakers, HTTP. Loaded from YAML.

`DeploymentConfig.from_dict` is what the Serve builder, the CLI and the
KubeRay manifests all go through, so a bad file is refused the same way
everywhere, with a message that names the field.

vLLM engine arguments: `engine_kwargs` (both roles) and `<role>.engine_kwargs`
(that role; wins over the shared ones) go to vLLM unchanged. The ones raypd
owns (model, dtype, max_model_len, tensor/pipeline parallel size, block size)
are moved into raypd's fields here, so each has one value (see
actors/engine/config.py). `check_engine_args` checks the rest against vLLM's
own argument classes where vLLM is importable (the CLI calls it; the engines
check again when they start).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from actors.engine.config import (
    DEPLOYMENT_FIELDS,
    GROUP_FIELDS,
    OWNED_KWARGS,
    Backend,
    DType,
    EngineConfig,
    SyntheticModelConfig,
    lift_owned_kwargs,
)
from actors.control.ledger import BreakerConfig
from serving.cluster.autoscale_policy import AutoscalerConfig

ROLES = ("prefill", "decode")


class ConfigError(ValueError):
    """A deployment file or dict is invalid; the message lists every problem."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class EngineGroupConfig(_Strict):
    """`count` engines of one role, all shaped alike."""

    count: int = Field(1, ge=0, le=64)
    tp_size: int = Field(1, ge=1, le=64)
    pp_size: int = Field(1, ge=1, le=64)
    dcp_size: int = Field(1, ge=1, le=64)
    block_size: int | None = Field(None, ge=1, le=1024)
    layout: str = "HND"
    kv_cache_space_gib: int = Field(1, ge=1, le=1024)
    num_blocks: int = Field(512, ge=1)
    num_cpus: float = Field(1.0, ge=0)
    resources: dict[str, float] = {}
    cpu_bind: list[str] | None = None  # one VLLM_CPU_OMP_THREADS_BIND per engine
    engine_kwargs: dict[str, Any] = {}  # vLLM engine arguments of this role (over the shared ones)


class RouterConfig(_Strict):
    """Engine choice and remote-vs-local prefill; formula and rules: serving/routing/policy.py."""

    # cache_aware: engines publish vLLM's KV cache events and the router scores cached prefix + load;
    # least_outstanding: load alone, and engines run without KV events
    policy: Literal["least_outstanding", "cache_aware"] = "cache_aware"
    cache_weight: float = Field(1.0, ge=0)  # cost of one uncached prompt token vs one token of queued work
    short_prompt_tokens: int = Field(0, ge=0)  # uncached prompt tokens below this: the decode engine prefills
    prefill_saturation_tokens: int = Field(0, ge=0)  # prefill queue that makes decode prefill itself (0: off)
    decode_headroom_tokens: int = Field(4096, ge=0)  # ...only while the decode engine owes fewer tokens
    index_refresh_s: float = Field(0.1, gt=0)  # how stale the router's copy of the prefix index may get
    no_prefill_fallback: Literal["decode_local", "reject"] = "decode_local"
    prefill_retries: int = Field(1, ge=0, le=3)
    # a stream whose decode engine died waits this long for one to take it (another, or the restarted one)
    migration_wait_s: float = Field(30.0, ge=0)


class TransferConfig(_Strict):
    failure_policy: Literal["fail", "recompute"] = "fail"
    lease_ttl_s: float = Field(30.0, gt=0)
    read_timeout_s: float = Field(10.0, gt=0)
    handoff_deadline_s: float = Field(60.0, gt=0)
    # a pull of at most this many tokens loads before the decode step's forward (no scheduler step
    # spent waiting for it); larger ones load asynchronously. 0: always async (EngineConfig)
    sync_load_max_tokens: int = Field(4096, ge=0)
    fault_rate: float = Field(0.0, ge=0.0, le=1.0)  # test knob: fail this fraction of KV pulls on purpose


class RestartConfig(_Strict):
    """Ray restarts crashed engines, their rank actors and the coordinator, at most this often."""

    max_restarts: int = Field(5, ge=0, le=1000)


class HttpConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # API keys never sit in the config (it travels as Serve arguments and shows in logs):
    # each ingress replica reads RAYPD_API_KEYS and this file when it starts (serving.front.api_keys).
    api_keys_file: str | None = None  # one key per line, '#' comments
    require_api_keys: bool = False  # refuse to start a replica that finds no key
    max_body_bytes: int = Field(1 << 20, ge=1024)
    served_model_name: str | None = None
    max_inflight_requests: int = Field(512, ge=1)  # per ingress replica; beyond it: 429
    num_replicas: int = Field(1, ge=1, le=64)  # Ray Serve ingress replicas
    replica_num_cpus: float = Field(0.0, ge=0)  # CPUs reserved per ingress replica

    @model_validator(mode="before")
    @classmethod
    def _no_inline_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "api_keys" in data:
            raise ValueError("inline API keys (http.api_keys) are not accepted: the config travels as Ray "
                             "Serve arguments and shows in logs. Put the keys in the RAYPD_API_KEYS "
                             "environment variable (comma-separated) or in a file named by http.api_keys_file "
                             "(one key per line)")
        return data


class RayConfig(_Strict):
    address: str | None = None  # None: start a local cluster
    num_cpus: int | None = Field(None, ge=1)


class DeploymentConfig(_Strict):
    name: str = "raypd"
    backend: Backend = "vllm"
    model: str = "smollm2"
    synthetic: SyntheticModelConfig = SyntheticModelConfig()
    dtype: DType = "auto"
    max_model_len: int = Field(2048, ge=16)
    engine_kwargs: dict[str, Any] = {}  # vLLM engine arguments of both roles
    prefill: EngineGroupConfig = EngineGroupConfig()
    decode: EngineGroupConfig = EngineGroupConfig()
    router: RouterConfig = RouterConfig()
    transfer: TransferConfig = TransferConfig()
    breaker: BreakerConfig = BreakerConfig()
    restarts: RestartConfig = RestartConfig()
    http: HttpConfig = HttpConfig()
    ray: RayConfig = RayConfig()
    autoscaler: AutoscalerConfig = AutoscalerConfig()  # P:D pool sizes (serving/cluster/autoscale_policy.py)

    @model_validator(mode="before")
    @classmethod
    def _lift_owned(cls, data: Any) -> Any:
        """Move owned engine arguments into raypd's fields (role kwargs before shared ones)."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        explicit = {f: f for f in DEPLOYMENT_FIELDS if f in data}
        shared = lift_owned_kwargs(data, dict(data.get("engine_kwargs") or {}), DEPLOYMENT_FIELDS,
                                   "engine_kwargs", explicit)
        shared_group = {k: v for k, v in shared.items() if OWNED_KWARGS.get(k) in GROUP_FIELDS}
        for role in ROLES:
            group = data.get(role)
            if group is not None and not isinstance(group, dict):
                continue  # pydantic reports the type error
            group = dict(group or {})
            own = {f: f"{role}.{f}" for f in GROUP_FIELDS if f in group}
            kwargs = lift_owned_kwargs(data, dict(group.get("engine_kwargs") or {}), DEPLOYMENT_FIELDS,
                                       f"{role}.engine_kwargs", explicit)
            set_by_role = {OWNED_KWARGS[k] for k in kwargs if OWNED_KWARGS.get(k) in GROUP_FIELDS}
            kwargs = lift_owned_kwargs(group, kwargs, GROUP_FIELDS, f"{role}.engine_kwargs", own)
            lift_owned_kwargs(group, {k: v for k, v in shared_group.items() if OWNED_KWARGS[k] not in set_by_role},
                              GROUP_FIELDS, "engine_kwargs", own)
            if "engine_kwargs" in group or kwargs:
                group["engine_kwargs"] = kwargs
            if group or role in data:
                data[role] = group
        if "engine_kwargs" in data or shared:
            data["engine_kwargs"] = {k: v for k, v in shared.items() if k not in shared_group}
        return data

    @model_validator(mode="after")
    def _cross_field(self) -> "DeploymentConfig":
        if self.decode.count < 1:
            raise ValueError("at least one decode engine is needed (decode.count >= 1)")
        if self.prefill.count == 0 and self.router.no_prefill_fallback == "reject":
            raise ValueError("no prefill engine and router.no_prefill_fallback=reject: nothing could be served")
        p, d = self.prefill, self.decode
        if self.prefill.count:
            big, small = max(p.tp_size, d.tp_size), min(p.tp_size, d.tp_size)
            if big % small:
                raise ValueError(f"prefill tp_size {p.tp_size} and decode tp_size {d.tp_size} must divide one another")
            pb, db = self.engine_config("prefill").effective_block_size, self.engine_config("decode").effective_block_size
            if db % pb:
                raise ValueError(f"prefill block_size {pb} must divide decode block_size {db}")
        for role, group in (("prefill", p), ("decode", d)):
            bounds = getattr(self.autoscaler, role)
            if self.autoscaler.enabled and not bounds.min <= group.count <= bounds.max:
                raise ValueError(f"{role}.count {group.count} must lie within autoscaler.{role} "
                                 f"min {bounds.min} .. max {bounds.max}")
            if group.cpu_bind is not None and len(group.cpu_bind) != group.count:
                raise ValueError(f"{role}.cpu_bind needs one entry per engine ({group.count})")
        for role in ("prefill", "decode"):
            try:
                self.engine_config(role)  # surfaces per-engine rules (dcp, heads, block size)
            except ValidationError as exc:
                raise ValueError(f"{role} engines: " + "; ".join(e["msg"] for e in exc.errors())) from None
        return self

    def engine_config(self, role: str, index: int = 0, engine_id: str | None = None) -> EngineConfig:
        group: EngineGroupConfig = getattr(self, "decode" if role == "both" else role)
        return EngineConfig(
            role=role, backend=self.backend, engine_id=engine_id, model=self.model,
            synthetic=self.synthetic, dtype=self.dtype, tp_size=group.tp_size, pp_size=group.pp_size,
            engine_kwargs={**self.engine_kwargs, **group.engine_kwargs},
            dcp_size=group.dcp_size, block_size=group.block_size, max_model_len=self.max_model_len,
            kv_cache_space_gib=group.kv_cache_space_gib, num_blocks=group.num_blocks, layout=group.layout,
            kv_load_failure_policy=self.transfer.failure_policy, lease_ttl_s=self.transfer.lease_ttl_s,
            read_timeout_s=self.transfer.read_timeout_s, fault_rate=self.transfer.fault_rate,
            sync_load_max_tokens=self.transfer.sync_load_max_tokens,
            num_cpus=group.num_cpus, kv_events=self.router.policy == "cache_aware",
            resources=group.resources,
            cpu_bind=group.cpu_bind[index] if group.cpu_bind and index < len(group.cpu_bind) else None,
        )

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
    if cfg.backend != "vllm" or not (cfg.engine_kwargs or cfg.prefill.engine_kwargs or cfg.decode.engine_kwargs):
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
