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

    model_id: str = Field("synthetic-tiny", description="the pretend model's name (what clients ask for)")
    num_layers: int = Field(4, ge=1, le=256, description="its layers (one KV cache per layer)")
    num_kv_heads: int = Field(4, ge=1, le=256, description="its KV heads (1 for an MLA model)")
    head_size: int = Field(32, ge=1, le=1024, description="the size of one head")
    is_mla: bool = Field(False, description="an MLA model: one latent KV head, no separate K and V")
    vocab_size: int = Field(32000, ge=16, description="the token ids it generates lie below this")
    token_latency_s: float = Field(0.0, ge=0.0, le=10.0, description="a pause per streamed token (tests, demos)")
    start_delay_s: float = Field(0.0, ge=0.0, le=600.0, description=(
        "a pause of every engine start before it registers (tests)"))

    @model_validator(mode="after")
    def _mla_has_one_head(self) -> "SyntheticModelConfig":
        if self.is_mla and self.num_kv_heads != 1:
            raise ValueError("an MLA model has one latent kv head: set num_kv_heads: 1")
        return self


class RatePriors(StrictModel):
    """Where every rate estimate starts and how fast it forgets: the deployment's `router.slo` carries
    them (`serving.placement_config.PlacementConfig`), each engine's own rate fit starts from them
    (`RateModelConfig`), and so does each router's estimator (`serving.routing.rates`)."""

    prior_prefill_tokens_per_s: float = Field(400.0, gt=0, description=(
        "prior of an engine's prefill rate (prompt tokens per second), until it measured its own"))
    prior_step_s: float = Field(0.05, gt=0, description="prior of a decode step's fixed part")
    prior_step_per_stream_s: float = Field(0.001, gt=0, description=(
        "prior of a decode step's growth per stream in the batch"))
    rate_half_life_s: float = Field(60.0, gt=0, description="half-life of an engine's rate samples in its fit")
    prior_weight: float = Field(1.0, gt=0, description="the priors count as this many average samples")
    min_history_weight: float = Field(4.0, ge=0, description=(
        "idle time never decays what an engine learned below this many samples"))
    prefill_busy_window_s: float = Field(10.0, gt=0, description=(
        "how far back the prompt tokens given to an engine per second are counted (its prefill share)"))

    def priors(self) -> dict[str, Any]:
        """This object's `RatePriors` fields, by name."""
        return {name: getattr(self, name) for name in RatePriors.model_fields}


class RateModelConfig(RatePriors):
    """How the engine fits its own rates (`actors.engine.rate_model`) and publishes them: the priors
    (the deployment's `router.slo` ones, or what the role's engines measured when the autoscaler
    starts this one), how fast old samples fade, how often the coordinator hears of them."""

    min_prefill_steps: float = Field(8.0, ge=0, description=(
        "a prefill teaches the fit only when its computed tokens cost at least this many steps' fixed part "
        "(a short or mostly cached prompt's time is its first token's fixed path, which the model has no "
        "term for)"))
    publish_interval_s: float = Field(0.5, gt=0, description=(
        "how often a material change of the rates may reach the coordinator"))
    republish_s: float = Field(10.0, gt=0, description=(
        "the rates are sent again this often even unchanged (a restarted coordinator hears them)"))


class CpuHostConfig(StrictModel):
    """CPU hosts only (a GPU host ignores them): how an engine's vLLM compute shares the cores."""

    compute_nice: int = Field(10, ge=0, le=19, description=(
        "vLLM's compute threads run this much nicer than the engine actor (capped at 19), so that the "
        "serving path (proxy, ingress, engine actors) runs first on shared cores; 0 leaves them alone"))
    shm_busy_loop_s: float | None = Field(None, ge=0, description=(
        "engines with worker processes: how long vLLM's shared-memory readers spin after a read before "
        "sleeping on the writer's notification (unset: vLLM's own 1 s; 0: no spin)"))


class EngineCpuConfig(CpuHostConfig):
    """One engine's `CpuHostConfig` and the cores it is bound to."""

    bind: str | None = Field(None, description='VLLM_CPU_OMP_THREADS_BIND of this engine ("0", "0|1", "nobind")')


class SyntheticPoolConfig(StrictModel):
    """The synthetic backend's KV cache of one engine (a vLLM engine ignores it)."""

    num_blocks: int = Field(512, ge=1, description="KV blocks of each engine (the synthetic backend)")
    layout: str = Field("HND", description="the KV blocks' layout (the synthetic backend): HND, NHD, HCND or ND")


class SyntheticEngineConfig(SyntheticModelConfig, SyntheticPoolConfig):
    """What a synthetic engine runs: the deployment's pretend model and its role's KV cache."""


class EngineSpec(StrictModel):
    """The shape of one engine: what the deployment's `<role>:` group sets for each of its engines
    (`serving.config.EngineGroupConfig`) and the engine's own config (`EngineConfig`) both embed."""

    tp_size: int = Field(1, ge=1, le=64, description="tensor-parallel ranks per engine (vLLM's tensor_parallel_size)")
    pp_size: int = Field(1, ge=1, le=64, description="pipeline-parallel ranks per engine")
    dcp_size: int = Field(1, ge=1, le=64, description=(
        "decode context parallel size: 1 or tp_size (an MLA model, synthetic backend only)"))
    block_size: int | None = Field(None, ge=1, le=1024, description=(
        "tokens per KV block (unset: the backend's default, 128 on vLLM's CPU, 16 synthetic); a prefill "
        "engine's must divide its decode engines'"))
    kv_cache_space_gib: int = Field(1, ge=1, le=1024, description=(
        "vLLM on a CPU host: KV cache per rank in GiB (VLLM_CPU_KVCACHE_SPACE)"))
    num_cpus: float = Field(1.0, ge=0, description="Ray CPUs each engine reserves")
    resources: dict[str, float] = Field({}, description=(
        "Ray custom resources each engine needs (e.g. {prefill: 1} places it on nodes labelled so)"))

    def spec(self) -> dict[str, Any]:
        """This object's `EngineSpec` fields, by name (what an `EngineConfig` embeds)."""
        return {name: getattr(self, name) for name in EngineSpec.model_fields}


class EngineConfig(EngineSpec):
    """One engine: its shape (`EngineSpec`), the deployment's model and transfer settings, and what
    raypd decided for it (engine arguments per platform, rate priors). Built by
    `serving.config.DeploymentConfig.engine_config`; internal, never written by hand in a file."""

    role: Role = Field(description="prefill, decode or both (role-flexible)")
    backend: Backend = Field("vllm", description="vllm, or synthetic (real KV caches and transfers, no model)")
    engine_id: str | None = Field(None, pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="its name in the cluster")
    model: str = Field("smollm2", description="vllm: the embedded model, a local folder or a hub id")
    model_id: str | None = Field(None, description=(
        "what the P/D compatibility check calls the model (unset: the folder's name)"))
    synthetic: SyntheticEngineConfig = Field(SyntheticEngineConfig(), description=(
        "the synthetic backend's pretend model and this engine's KV cache"))
    dtype: DType = Field("auto", description="vLLM's dtype")
    max_model_len: int = Field(2048, ge=16, description="longest prompt + answer, in tokens")
    transfer: TransferConfig = Field(TransferConfig(), description=(
        "the deployment's `transfer:` section as is: the engine, its backends and the vLLM connector "
        "read the same fields"))
    cpu: EngineCpuConfig = Field(EngineCpuConfig(), description="CPU-host settings and this engine's cores")
    engine_kwargs: dict[str, Any] = Field({}, description=(
        "vLLM engine arguments, passed through (actors.engine.vllm.args)"))
    cpu_engine_defaults: dict[str, Any] = Field({}, description=(
        "engine arguments raypd sets on a CPU host where engine_kwargs has none (a prefill engine's "
        "max_num_seqs 1, the chunk budget from measured rates or the SLO priors)"))
    gpu_engine_defaults: dict[str, Any] = Field({}, description=(
        "engine arguments raypd sets on any other platform (a GPU) where engine_kwargs has none: only a "
        "measured chunk budget larger than `vllm serve`'s; vLLM's defaults stand for the rest"))
    kv_connector: bool = Field(True, description=(
        "false: plain vLLM without a KV connector (role both only; a benchmark's baseline), which "
        "cannot take part in P/D"))
    kv_events: bool = Field(True, description=(
        "vLLM publishes its KV cache events and the engine relays them to the coordinator's prefix "
        "index (router.policy cache_aware)"))
    max_restarts: int = Field(5, ge=0, le=1000, description=(
        "Ray restarts the engine's rank actors (synthetic backend) at most this often"))
    rates: RateModelConfig = Field(RateModelConfig(), description="its own rate fit and its publication")

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
