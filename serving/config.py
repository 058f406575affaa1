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

raypd sets three engine arguments where the operator wrote none (`EngineConfig.cpu_engine_defaults`
and `gpu_engine_defaults`, applied by the engine for its platform; `raypd config` prints them):

- a one-rank engine on a CPU host runs its model in vLLM's engine-core process
  (`distributed_executor_backend: uni`, which vLLM's CPU platform would turn into `mp`:
  actors/engine/vllm/uniproc.py has why, what raypd does to keep it, and the figures);

- the chunk budget (`max_num_batched_tokens`) of decode-capable engines under SLO placement:
  derived from the rates the role's live engines measured when an engine is started with them
  (`MeasuredRates`: the autoscaler's starts), else from the placement priors (CPU priors).
  A CPU engine runs it; a GPU engine runs it only when it is a measured one larger than vLLM's
  own default, so a GPU engine never gets a smaller budget than vLLM's unless the operator wrote it;
- a prefill engine runs one prompt at a time on a CPU host (`max_num_seqs` 1,
  `PREFILL_DEFAULT_KWARGS`; a GPU prefill engine batches prompts as vLLM does). vLLM would pack
  every queued prompt into one step of up to `max_num_batched_tokens`, so that each of them gets
  its first token only when the whole pack is computed (four 512-token prompts: ~4x one prompt's
  time for all four on a CPU core); one at a time, first come first served, the first of them is
  back after its own prefill. A prefill's request leaves vLLM's running set with its first token
  (its blocks stay under their lease), so this bounds only the compute.
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
    RateModelConfig,
    SyntheticModelConfig,
    lift_owned_kwargs,
)
from actors.control.ledger import BreakerConfig
from actors.transfer_config import TransferConfig

# serving/'s ground floor: of serving/ only the config types kept beside this file, which import
# nothing of serving/ themselves; routing and cluster import them from there (tests/unit/test_config_layers.py)
from serving.autoscaler_config import AutoscalerConfig
from serving.placement_config import ChunkBudget, MeasuredRates, PlacementConfig, vllm_default_budget

ROLES = ("prefill", "decode", "both")
PREFILL_CAPABLE, DECODE_CAPABLE = ("prefill", "both"), ("decode", "both")
# vLLM engine arguments a prefill engine gets unless its engine_kwargs set them (see the module docstring)
PREFILL_DEFAULT_KWARGS: dict[str, Any] = {"max_num_seqs": 1}


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
    compute_nice: int = Field(10, ge=0, le=19)  # CPU hosts: vLLM's compute this much nicer than its actor
    shm_busy_loop_s: float | None = Field(None, ge=0)  # vLLM's shared-memory readers' spin (None: vLLM's 1 s)
    engine_kwargs: dict[str, Any] = {}  # vLLM engine arguments of this role (over the shared ones)


class RouterConfig(_Strict):
    """Engine choice and colocated-vs-disaggregated placement (serving/routing/planner.py)."""

    # cache_aware: engines publish vLLM's KV cache events and the router counts each engine's cached
    # prefix of the prompt; least_outstanding: load alone, and engines run without KV events
    policy: Literal["least_outstanding", "cache_aware"] = "cache_aware"
    cache_weight: float = Field(1.0, ge=0)  # cost of one uncached prompt token vs one token of queued work
    # slo: per request, the SLO model (serving/routing/slo_model.py) picks colocated or disaggregated and
    # where; disaggregate: every request is prefilled remotely whenever a prefill engine is usable
    placement: Literal["slo", "disaggregate"] = "slo"
    slo: PlacementConfig = PlacementConfig()  # targets, weights and the priors rates start from
    index_refresh_s: float = Field(0.1, gt=0)  # how stale the router's copy of the prefix index may get
    no_prefill_fallback: Literal["decode_local", "reject"] = "decode_local"
    prefill_retries: int = Field(1, ge=0, le=3)
    # a stream whose decode engine died (or hung) waits this long for one to take it (another, or the
    # restarted one); past it the stream ends with an error event
    migration_wait_s: float = Field(15.0, ge=0)
    # Deadlines of the engine calls a client waits for (formulas: serving/routing/deadlines.py):
    # a prefill call or a stream's first chunk gets floor + margin x the prefill's predicted time at
    # the engine's own published rates and queue (the priors of `slo` until it measured them; +
    # transfer.read_timeout_s when the decode engine pulls KV first); every later chunk
    # max(token_timeout_s, margin x the engine's step at its published batch). A wait past its
    # deadline goes on while the engine answers other calls (silent < token_timeout_s), up to margin x
    # its deadline: busy is not hung. An engine that misses one is treated as hung: its streams
    # migrate, the coordinator is told (it probes, evicts and restarts the engine), and this router
    # gives it no work meanwhile.
    deadline_floor_s: float = Field(10.0, gt=0)
    deadline_margin: float = Field(3.0, ge=1.0)
    token_timeout_s: float = Field(10.0, gt=0)  # per-token inactivity of a stream (floor)
    # a suspected engine gets no new work from this router this long, unless the directory lists a
    # new incarnation of it sooner (the coordinator's probe decides within restarts.probe_timeout_s)
    hung_engine_hold_s: float = Field(30.0, gt=0)


class RestartConfig(_Strict):
    """Ray restarts crashed engines, their rank actors (synthetic engines), the coordinator and the
    autoscaler, each at most `max_restarts` times. A hung engine is restarted too: the coordinator
    pings every engine each `probe_interval_s` (and at once, then again after each failure, when
    a router reports a missed deadline); one that fails `probe_failure_threshold` probes in a row
    (no answer within `probe_timeout_s` while it calls the coordinator for nothing else, or vLLM's
    engine core behind it neither answering nor stepping: one slow answer on busy cores is not a
    hang) is evicted and killed, and Ray restarts it as a new incarnation. A restarted engine that has not registered again within `startup_deadline_s`
    (unset: the launcher's engine start timeout) is killed and restarted again (a restart that hangs
    while it starts cannot be probed)."""

    max_restarts: int = Field(5, ge=0, le=1000)
    probe_interval_s: float = Field(10.0, gt=0)
    probe_timeout_s: float = Field(10.0, gt=0)
    probe_failure_threshold: int = Field(2, ge=1, le=100)
    startup_deadline_s: float | None = Field(None, gt=0)


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
    # When Serve stops an ingress replica (a redeploy, a scale-down; never because an engine is
    # down: its health check reports the replica alone), its streams get this long to finish
    # before it is force-stopped: cover the longest answer (max_tokens x inter-token latency).
    graceful_shutdown_timeout_s: float = Field(120.0, ge=0)
    replica_num_cpus: float = Field(0.0, ge=0)  # CPUs reserved per ingress replica
    # answer requests sent with `X-Raypd-Trace: 1` with their first token's hop stamps (serving.front.trace)
    trace: bool = False

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
    # role-flexible engines: each can prefill for a peer, decode a peer's prefill, or serve a request
    # end to end; the router places every request (router.placement). Given alone, there are no fixed pools.
    both: EngineGroupConfig = EngineGroupConfig(count=0)
    router: RouterConfig = RouterConfig()
    transfer: TransferConfig = TransferConfig()  # the engines' EngineConfig.transfer, as is (actors.transfer_config)
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
        both = data.get("both")
        if isinstance(both, dict) and both.get("count", 0):  # role-flexible engines only, unless pools are given
            for role in ("prefill", "decode"):
                data.setdefault(role, {"count": 0})
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
            if group.cpu_bind is not None and len(group.cpu_bind) != group.count:
                raise ValueError(f"{role}.cpu_bind needs one entry per engine ({group.count})")
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
        if self.backend != "vllm" or role not in DECODE_CAPABLE or self.router.placement != "slo":
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
        slo = self.router.slo
        return RateModelConfig(
            prior_prefill_tokens_per_s=measured.prefill_tokens_per_s if measured else slo.prior_prefill_tokens_per_s,
            prior_step_s=measured.step_s if measured else slo.prior_step_s,
            prior_step_per_stream_s=slo.prior_step_per_stream_s, half_life_s=slo.rate_half_life_s,
            prior_weight=slo.prior_weight, min_history_weight=slo.min_history_weight,
            busy_window_s=slo.prefill_busy_window_s)

    def engine_config(self, role: str, index: int = 0, engine_id: str | None = None,
                      measured: MeasuredRates | None = None) -> EngineConfig:
        """Engine `index` of `role`; `measured`: the rates the role's live engines measured, when it
        is started beside them (its chunk budget then comes from them, not from the priors)."""
        group: EngineGroupConfig = getattr(self, role)
        kwargs = {**self.engine_kwargs, **group.engine_kwargs}
        # applied by the engine where the operator wrote none: on a CPU host raypd's tuned values, on
        # a GPU only a measured budget above vLLM's own (its defaults stand otherwise: see the docstring)
        cpu_defaults: dict[str, Any] = {}
        gpu_defaults: dict[str, Any] = {}
        if role == "prefill" and self.backend == "vllm":
            cpu_defaults.update({k: v for k, v in PREFILL_DEFAULT_KWARGS.items() if k not in kwargs})
        if self.backend == "vllm" and group.tp_size * group.pp_size == 1 and "distributed_executor_backend" not in kwargs:
            cpu_defaults["distributed_executor_backend"] = "uni"  # the model runs in the core process (see above)
        budget = self.chunk_budget_of(role, measured)
        if budget is not None and budget.source != "operator":
            cpu_defaults["max_num_batched_tokens"] = budget.tokens
            if budget.source == "measured" and budget.tokens > vllm_default_budget(kwargs):
                gpu_defaults["max_num_batched_tokens"] = budget.tokens
        return EngineConfig(
            role=role, backend=self.backend, engine_id=engine_id, model=self.model,
            synthetic=self.synthetic, dtype=self.dtype, tp_size=group.tp_size, pp_size=group.pp_size,
            engine_kwargs=kwargs, cpu_engine_defaults=cpu_defaults, gpu_engine_defaults=gpu_defaults,
            dcp_size=group.dcp_size, block_size=group.block_size, max_model_len=self.max_model_len,
            kv_cache_space_gib=group.kv_cache_space_gib, num_blocks=group.num_blocks, layout=group.layout,
            transfer=self.transfer,
            num_cpus=group.num_cpus, kv_events=self.router.policy == "cache_aware",
            resources=group.resources, max_restarts=self.restarts.max_restarts,
            cpu_bind=group.cpu_bind[index] if group.cpu_bind and index < len(group.cpu_bind) else None,
            compute_nice=group.compute_nice, shm_busy_loop_s=group.shm_busy_loop_s,
            rates=self.rate_model(measured),
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
