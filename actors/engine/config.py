"""The pydantic configuration of one engine (prefill, decode or colocated).

Validated once, at the boundary (config file, Serve builder, CLI); everything
below receives a typed, frozen object. Cross-field rules say what vLLM or the
KV transfer would otherwise refuse much later and less clearly.

`engine_kwargs` go to vLLM's engine arguments unchanged (checked against
vLLM's own argument classes by `actors.engine.vllm.args`). The few engine arguments
raypd needs to know itself, for P/D compatibility checks and request
validation (model, dtype, max_model_len, TP/PP/DCP sizes, block size), have
one home: raypd's own fields. Written as engine_kwargs they are moved into
those fields (`actors.engine.vllm.lifting`); a contradiction is refused.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from actors.config_base import StrictModel
from actors.engine.vllm.lifting import DEPLOYMENT_FIELDS, GROUP_FIELDS, OWNED_KWARGS, lift_owned_kwargs
from actors.transfer_config import TransferConfig

Role = Literal["prefill", "decode", "both"]
Backend = Literal["vllm", "synthetic"]
# vLLM's `dtype` values ("auto": the model's own, as vLLM picks it for the platform)
DType = Literal["auto", "float32", "float", "bfloat16", "float16", "half"]

class SyntheticModelConfig(StrictModel):
    """KV shapes of the synthetic backend's pretend model."""

    model_id: str = "synthetic-tiny"
    num_layers: int = Field(4, ge=1, le=256)
    num_kv_heads: int = Field(4, ge=1, le=256)
    head_size: int = Field(32, ge=1, le=1024)
    is_mla: bool = False
    vocab_size: int = Field(32000, ge=16)
    token_latency_s: float = Field(0.0, ge=0.0, le=10.0)  # pause per streamed token (tests, demos)
    start_delay_s: float = Field(0.0, ge=0.0, le=600.0)  # pause of every start before it registers (tests)

    @model_validator(mode="after")
    def _mla_has_one_head(self) -> "SyntheticModelConfig":
        if self.is_mla and self.num_kv_heads != 1:
            raise ValueError("an MLA model has one latent kv head: set num_kv_heads: 1")
        return self


class RatePriors(StrictModel):
    """Where every rate estimate starts and how fast it forgets: the deployment's `router.slo` carries
    them (`serving.placement_config.PlacementConfig`), each engine's own rate fit starts from them
    (`RateModelConfig`), and so does each router's estimator (`serving.routing.rates`)."""

    # priors, used until engines report samples (any machine, any model: samples replace them in seconds)
    prior_prefill_tokens_per_s: float = Field(400.0, gt=0)
    prior_step_s: float = Field(0.05, gt=0)  # a decode step's fixed part
    prior_step_per_stream_s: float = Field(0.001, gt=0)  # ...and its growth per stream in the batch
    # online learning: exponentially weighted, by age
    rate_half_life_s: float = Field(60.0, gt=0)
    prior_weight: float = Field(1.0, gt=0)  # the priors count as this many average samples
    min_history_weight: float = Field(4.0, ge=0)  # idle time never decays what was learned below this
    prefill_busy_window_s: float = Field(10.0, gt=0)  # how far back the prompt tokens given per second reach

    def priors(self) -> dict[str, Any]:
        """This object's `RatePriors` fields, by name."""
        return {name: getattr(self, name) for name in RatePriors.model_fields}


class RateModelConfig(RatePriors):
    """How the engine fits its own rates (`actors.engine.rate_model`) and publishes them: the priors
    (the deployment's `router.slo` ones, or what the role's engines measured when the autoscaler
    starts this one), how fast old samples fade, how often the coordinator hears of them."""

    # a prefill teaches the fit only when its computed tokens cost at least this many steps' fixed part
    # (a short or mostly cached prompt's time is its first token's fixed path, which the model has no
    # term for: one such prompt made an engine's published prefill rate several times too slow)
    min_prefill_steps: float = Field(8.0, ge=0)
    publish_interval_s: float = Field(0.5, gt=0)  # how often a material change may reach the coordinator
    republish_s: float = Field(10.0, gt=0)  # sent again this often even unchanged (a restarted coordinator)


class CpuHostConfig(StrictModel):
    """CPU hosts only (a GPU host ignores them): how an engine's vLLM compute shares the cores."""

    # how far above the engine actor's own nice value vLLM's compute threads run (capped at 19), so
    # that the serving path preempts the compute (actors/engine/vllm/compute_priority.py); 0 leaves
    # them at the actor's priority
    compute_nice: int = Field(10, ge=0, le=19)
    # how long vLLM's shared-memory readers (engine core, workers) spin on sched_yield after a read
    # before sleeping on the writer's notification (actors/engine/vllm/plugin.py); None: vLLM's own
    # (1 s). 0 stops the engine cores' spin; not the default until a benchmark shows it faster
    shm_busy_loop_s: float | None = Field(None, ge=0)


class EngineCpuConfig(CpuHostConfig):
    """One engine's `CpuHostConfig` and the cores it is bound to."""

    bind: str | None = None  # VLLM_CPU_OMP_THREADS_BIND for this engine ("0", "0|1", "nobind")


class SyntheticPoolConfig(StrictModel):
    """The synthetic backend's KV cache of one engine (a vLLM engine ignores it)."""

    num_blocks: int = Field(512, ge=1)
    layout: str = "HND"  # HND | NHD | HCND | ND


class SyntheticEngineConfig(SyntheticModelConfig, SyntheticPoolConfig):
    """What a synthetic engine runs: the deployment's pretend model and its role's KV cache."""


class EngineSpec(StrictModel):
    """The shape of one engine: what the deployment's `<role>:` group sets for each of its engines
    (`serving.config.EngineGroupConfig`) and the engine's own config (`EngineConfig`) both embed."""

    tp_size: int = Field(1, ge=1, le=64)
    pp_size: int = Field(1, ge=1, le=64)
    dcp_size: int = Field(1, ge=1, le=64)
    block_size: int | None = Field(None, ge=1, le=1024)  # None: backend default
    kv_cache_space_gib: int = Field(1, ge=1, le=1024)  # vLLM CPU KV cache per rank (GiB, whole)
    num_cpus: float = Field(1.0, ge=0)
    resources: dict[str, float] = {}

    def spec(self) -> dict[str, Any]:
        """This object's `EngineSpec` fields, by name (what an `EngineConfig` embeds)."""
        return {name: getattr(self, name) for name in EngineSpec.model_fields}


class EngineConfig(EngineSpec):
    role: Role
    backend: Backend = "vllm"
    engine_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    model: str = "smollm2"  # vllm: the embedded model, a local folder or a hub id
    model_id: str | None = None  # what the compatibility hash calls the model (default: folder name)
    synthetic: SyntheticEngineConfig = SyntheticEngineConfig()
    dtype: DType = "auto"
    max_model_len: int = Field(2048, ge=16)
    # the deployment's `transfer:` section as is (failure policy, leases, timeouts, verify, the
    # fault knob): one type, so the engine, its backends and the vLLM connector read the same fields
    transfer: TransferConfig = TransferConfig()
    cpu: EngineCpuConfig = EngineCpuConfig()
    engine_kwargs: dict[str, Any] = {}  # vLLM engine arguments, passed through (actors.engine.vllm.args)
    # vLLM engine arguments raypd sets on a CPU host where engine_kwargs has none (tuned there: a prefill
    # engine's FCFS max_num_seqs 1, the chunk budget from measured rates or the SLO priors) ...
    cpu_engine_defaults: dict[str, Any] = {}
    # ... and on any other platform (a GPU): only a chunk budget from measured rates that is larger
    # than vLLM's own default; vLLM's defaults stand for everything else
    gpu_engine_defaults: dict[str, Any] = {}
    # False: plain vLLM with no KV connector at all (role "both" only). Used as the
    # colocated baseline of benchmarks/pd_vs_vllm.py; such an engine cannot take part
    # in P/D (it publishes no handshake payload).
    kv_connector: bool = True
    # vLLM publishes its KV cache events (kv_events_config) and the engine relays them to the
    # coordinator's prefix index: on when the deployment routes cache-aware (router.policy).
    kv_events: bool = True
    # Ray restarts the engine's rank actors (synthetic backend) at most this often (restarts.max_restarts)
    max_restarts: int = Field(5, ge=0, le=1000)
    rates: RateModelConfig = RateModelConfig()  # its own rate fit and its publication

    @model_validator(mode="before")
    @classmethod
    def _lift_owned(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not data.get("engine_kwargs"):
            return data
        data = dict(data)
        explicit = {f: f for f in set(OWNED_KWARGS.values()) if f in data}
        data["engine_kwargs"] = lift_owned_kwargs(data, dict(data["engine_kwargs"]),
                                                  GROUP_FIELDS | DEPLOYMENT_FIELDS, "engine_kwargs", explicit)
        return data

    @model_validator(mode="after")
    def _cross_field(self) -> "EngineConfig":
        if not self.kv_connector and (self.role != "both" or self.backend != "vllm"):
            raise ValueError("kv_connector: false (plain vLLM) needs role 'both' and the vllm backend")
        if self.dcp_size not in (1, self.tp_size):
            raise ValueError(f"dcp_size {self.dcp_size} must be 1 or tp_size {self.tp_size}")
        if self.backend == "vllm":
            if self.dcp_size != 1:
                raise ValueError("dcp_size > 1 is only supported by the synthetic backend here")
            if self.block_size is not None and self.block_size % 16:
                raise ValueError(f"vLLM block_size must be a multiple of 16, got {self.block_size}")
        else:
            m = self.synthetic
            if self.dcp_size > 1 and not m.is_mla:
                raise ValueError("dcp_size > 1 needs an MLA synthetic model (synthetic.is_mla: true)")
            if not m.is_mla:
                heads, tp = m.num_kv_heads, self.tp_size
                if (tp <= heads and heads % tp) or (tp > heads and tp % heads):
                    raise ValueError(f"tp_size {tp} must divide, or be a multiple of, num_kv_heads {heads}")
            if self.pp_size > m.num_layers:
                raise ValueError(f"pp_size {self.pp_size} exceeds the model's {m.num_layers} layers")
        return self

    @property
    def served_model_id(self) -> str:
        if self.model_id:
            return self.model_id
        if self.backend == "synthetic":
            return self.synthetic.model_id
        return "SmolLM2-135M-Instruct" if self.model in ("smollm2", "embedded") else self.model.rstrip("/").rsplit("/", 1)[-1]

    @property
    def effective_block_size(self) -> int:
        if self.block_size is not None:
            return self.block_size
        return 128 if self.backend == "vllm" else 16
