"""vLLM engine arguments of one raypd engine: the user's engine_kwargs, unchanged, plus the little P/D needs.

`check_engine_kwargs` validates engine_kwargs with vLLM's own classes (each key a field of
`AsyncEngineArgs`, each value of its type, the whole constructible; errors name the key), when a
config is checked and again when an engine starts. `build_engine_args` adds the fields raypd owns
(`actors.engine.config`) and what P/D needs (the KV connector and its role, engine stats on, on the
CPU model runner raypd's `ResumedPenalties` logits processor); where that replaces a user's value,
`pd_overrides` says so in one line each. Everything else follows vLLM's defaults. vLLM is imported
lazily: the config layer stays importable without it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util
import json
import os
import platform
from typing import Any

from actors.engine.config import EngineConfig
from actors.engine.vllm.serve_defaults import BatchDefaults, serve_batch_defaults

CONNECTOR = "RayNixlConnector"
CONNECTOR_MODULE = "actors.engine.vllm.connector"
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer", "both": "kv_both"}
# kv_transfer_config fields raypd sets for P/D; the user's other fields pass through.
PD_KV_FIELDS = ("kv_connector", "kv_connector_module_path", "kv_role", "engine_id", "kv_load_failure_policy",
                "kv_connector_extra_config")


class EngineArgsError(ValueError):
    """An engine_kwargs entry vLLM would refuse; `key` names it."""

    def __init__(self, key: str, message: str):
        self.key, self.reason = key, message
        super().__init__(f"{key}: {message}")

    def __reduce__(self) -> tuple:  # crosses Ray (an engine's start error) intact
        return type(self), (self.key, self.reason)


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


@functools.lru_cache(maxsize=1)
def _fields() -> dict[str, Any]:
    from vllm.engine.arg_utils import AsyncEngineArgs

    return {f.name: f for f in dataclasses.fields(AsyncEngineArgs)}


@functools.lru_cache(maxsize=None)
def _adapter(name: str) -> Any:
    """A pydantic validator for one engine argument's declared type (None: vLLM's constructor checks it)."""
    from pydantic import ConfigDict, TypeAdapter

    hint = _fields()[name].type
    if isinstance(hint, str):
        return None
    try:
        return TypeAdapter(hint, config=ConfigDict(arbitrary_types_allowed=True))
    except Exception:  # noqa: BLE001 - a type pydantic cannot express: the constructor decides
        return None


def _pydantic_reason(exc: Any) -> str:
    first = exc.errors()[0]
    loc = ".".join(str(p) for p in first.get("loc", ()) if not str(p).startswith("function-"))
    return (f"{loc}: " if loc else "") + f"{first['msg']} (got {first.get('input')!r})"


def check_engine_kwargs(kwargs: dict[str, Any]) -> None:
    """Raise EngineArgsError naming the first key vLLM's engine arguments refuse."""
    from pydantic import ValidationError
    from vllm.engine.arg_utils import AsyncEngineArgs

    fields = _fields()
    for key, value in kwargs.items():
        if key not in fields:
            close = difflib.get_close_matches(key, list(fields), n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise EngineArgsError(key, f"not a vLLM engine argument (vllm.engine.arg_utils.AsyncEngineArgs){hint}")
        adapter = _adapter(key)
        if adapter is not None:
            try:
                adapter.validate_python(value)
            except ValidationError as exc:
                raise EngineArgsError(key, _pydantic_reason(exc)) from None
    try:  # vLLM's own __post_init__ checks (nested configs, quantization, ...); "." keeps the model lookup local
        AsyncEngineArgs(model=os.curdir, **kwargs)
    except Exception as whole:  # noqa: BLE001 - find the key that vLLM refused
        for key, value in kwargs.items():
            try:
                AsyncEngineArgs(model=os.curdir, **{key: value})
            except ValidationError as exc:
                raise EngineArgsError(key, _pydantic_reason(exc)) from None
            except Exception as exc:  # noqa: BLE001
                raise EngineArgsError(key, f"{type(exc).__name__}: {exc}") from None
        raise EngineArgsError(",".join(kwargs), f"{type(whole).__name__}: {whole}") from None


def pd_kv_transfer(cfg: EngineConfig, engine_id: str, extra_config: dict[str, Any]) -> dict[str, Any]:
    """The kv_transfer_config fields P/D needs: raypd's connector in this engine's role."""
    return {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": KV_ROLES[cfg.role],
        "engine_id": engine_id,
        "kv_load_failure_policy": cfg.transfer.failure_policy,
        "kv_connector_extra_config": extra_config,
    }


def pd_overrides(cfg: EngineConfig) -> list[str]:
    """One line per user engine argument raypd replaces (only kv_transfer_config fields and stats)."""
    if not cfg.kv_connector:
        return []
    notes = []
    user_kv = cfg.engine_kwargs.get("kv_transfer_config") or {}
    if isinstance(user_kv, dict):
        ours = pd_kv_transfer(cfg, "<engine id>", {})
        for key in PD_KV_FIELDS:
            if key in user_kv and user_kv[key] != ours[key]:
                shown = "raypd's settings" if key == "kv_connector_extra_config" else repr(ours[key])
                notes.append(f"engine_kwargs.kv_transfer_config.{key}={user_kv[key]!r} is replaced by {shown}: "
                             f"P/D moves the KV with raypd's {CONNECTOR} in role {KV_ROLES[cfg.role]}")
    if cfg.engine_kwargs.get("disable_log_stats"):
        notes.append("engine_kwargs.disable_log_stats=True is replaced by False: raypd reads the engine's "
                     "KV usage from vLLM's stats")
    return notes


def build_engine_args(cfg: EngineConfig, model_path: str, kv_transfer: dict[str, Any] | None) -> Any:
    """`AsyncEngineArgs` for one engine: engine_kwargs + raypd's fields + P/D's kv_transfer_config."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs

    kwargs = dict(cfg.engine_kwargs)
    check_engine_kwargs(kwargs)
    kwargs = {**platform_defaults(cfg), **kwargs}
    kwargs.setdefault("tokenizer", model_path)
    if cfg.block_size is not None:
        kwargs["block_size"] = cfg.block_size
    if cfg.tp_size * cfg.pp_size > 1:
        # the engine runs inside a Ray placement group, where vLLM would pick its Ray executor
        # (refused on CPU); its workers are local processes anyway
        kwargs.setdefault("distributed_executor_backend", "mp")
    processors = resumed_logits_processors(kwargs)
    if processors is not None:
        kwargs["logits_processors"] = processors
    user_kv = kwargs.pop("kv_transfer_config", None)
    if kv_transfer is not None:
        merged = {**(user_kv if isinstance(user_kv, dict) else {}), **kv_transfer}
        kwargs["kv_transfer_config"] = KVTransferConfig(**merged)
        kwargs["disable_log_stats"] = False
    elif user_kv is not None:
        kwargs["kv_transfer_config"] = user_kv if not isinstance(user_kv, dict) else KVTransferConfig(**user_kv)
    args = AsyncEngineArgs(model=model_path, dtype=cfg.dtype, max_model_len=cfg.max_model_len,
                           tensor_parallel_size=cfg.tp_size, pipeline_parallel_size=cfg.pp_size, **kwargs)
    apply_cpu_mla_backend(args)
    return args


def platform_defaults(cfg: EngineConfig, is_cpu: bool | None = None,
                      serve: BatchDefaults | None = None) -> dict[str, Any]:
    """The engine arguments raypd adds where the operator set none: `cpu_engine_defaults` on a CPU
    host (`is_cpu`: this host's vLLM platform when None), `gpu_engine_defaults` elsewhere: a measured
    chunk budget only when it is larger than `vllm serve`'s default for this host's GPU (`serve`:
    read from vLLM's table when None); vLLM applies `vllm serve`'s defaults for the rest."""
    if is_cpu is None:
        from vllm.platforms import current_platform

        is_cpu = current_platform.is_cpu()
    if is_cpu:
        return {k: v for k, v in cfg.cpu_engine_defaults.items() if k not in cfg.engine_kwargs}
    defaults = {k: v for k, v in cfg.gpu_engine_defaults.items() if k not in cfg.engine_kwargs}
    budget = defaults.get("max_num_batched_tokens")
    if budget is not None:
        serve = serve or serve_batch_defaults(cfg.tp_size * cfg.pp_size, cfg.engine_kwargs.get("performance_mode"))
        if budget <= serve.max_num_batched_tokens:
            del defaults["max_num_batched_tokens"]  # vLLM's own is at least as large
    return defaults


def apply_cpu_mla_backend(args: Any) -> str | None:
    """On an AMX CPU, an MLA model in float32 runs vLLM's portable CPU_MLA backend (AMX_MLA refuses
    float32 weights: `actors.engine.vllm.cpu_kernels`); returns the MLA backend the engine will run."""
    from vllm.platforms import current_platform

    from actors.engine.vllm.cpu_kernels import CpuKernelError, host_cpu_flags, host_has_amx, mla_backend_choice

    if not current_platform.is_cpu() or not host_has_amx() or not _may_use_mla(args.model):
        return None  # vLLM's own choice is one that starts (CPU_MLA or a GPU backend)
    try:
        model_config = args.create_model_config()  # the HF config: is it MLA, which dtype "auto" resolves to
    except Exception:  # noqa: BLE001 - a model vLLM cannot load: the engine's start reports it
        return None
    user = args.attention_backend or args.attention_config.backend
    dtype = str(model_config.dtype).removeprefix("torch.")
    try:
        choice = mla_backend_choice(host_cpu_flags(), "x86_64", bool(model_config.use_mla), dtype,
                                    user.name if user is not None else None)
    except CpuKernelError as exc:
        raise EngineArgsError("attention_config.backend", str(exc)) from None
    if choice.backend is not None:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        args.attention_config.backend = AttentionBackendEnum[choice.backend]
    return choice.runs


def resumed_logits_processors(kwargs: dict[str, Any]) -> list[Any] | None:
    """The user's logits processors plus raypd's `ResumedPenalties` (last: it must run right
    before vLLM's own penalties), on the V1 CPU model runner; None: leave them as they are
    (speculative decoding refuses custom processors; other runners have their own interface)."""
    from vllm.platforms import current_platform

    from actors.engine.vllm.resumed import QUALNAME

    if not current_platform.is_cpu() or kwargs.get("speculative_config"):
        return None
    user = [p for p in (kwargs.get("logits_processors") or []) if p != QUALNAME]
    return [*user, QUALNAME]


@dataclasses.dataclass(frozen=True)
class EffectiveEngineConfig:
    """What the running vLLM engine actually uses (read back from its VllmConfig)."""

    model: str
    dtype: str
    max_model_len: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    block_size: int
    enable_prefix_caching: bool
    max_num_seqs: int
    max_num_batched_tokens: int
    enforce_eager: bool
    kv_role: str | None
    num_kv_blocks: int
    mla_backend: str | None = None  # the MLA attention backend on a CPU (None: not MLA, or not a CPU)
    async_scheduling: bool = False  # vLLM's batch queue of two steps (vLLM's default: on, but off on CPU)

    @classmethod
    def from_vllm_config(cls, vc: Any) -> "EffectiveEngineConfig":
        kv = vc.kv_transfer_config
        return cls(
            model=str(vc.model_config.model), dtype=str(vc.model_config.dtype).removeprefix("torch."),
            max_model_len=int(vc.model_config.max_model_len),
            tensor_parallel_size=int(vc.parallel_config.tensor_parallel_size),
            pipeline_parallel_size=int(vc.parallel_config.pipeline_parallel_size),
            block_size=int(vc.cache_config.block_size),
            enable_prefix_caching=bool(vc.cache_config.enable_prefix_caching),
            max_num_seqs=int(vc.scheduler_config.max_num_seqs),
            max_num_batched_tokens=int(vc.scheduler_config.max_num_batched_tokens),
            enforce_eager=bool(vc.model_config.enforce_eager),
            kv_role=kv.kv_role if kv is not None else None,
            num_kv_blocks=int(vc.cache_config.num_gpu_blocks or 0),
            mla_backend=_cpu_mla_backend(vc),
            async_scheduling=bool(vc.scheduler_config.async_scheduling),
        )


def _may_use_mla(model: str) -> bool:
    """False when the model's config.json says it has no MLA latent (no `kv_lora_rank`): a cheap
    look before vLLM's own model config is built; True when there is none to read."""
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        return True
    with open(path, encoding="utf-8") as f:
        hf = json.load(f)
    return any(c.get("kv_lora_rank") is not None for c in (hf, hf.get("text_config") or {}))


def _cpu_mla_backend(vc: Any) -> str | None:
    from vllm.platforms import current_platform

    from actors.engine.vllm.cpu_kernels import host_cpu_flags, mla_backend_choice

    if not current_platform.is_cpu() or not vc.model_config.use_mla:
        return None
    chosen = vc.attention_config.backend
    return mla_backend_choice(host_cpu_flags(), platform.machine(), True,
                              str(vc.model_config.dtype).removeprefix("torch."),
                              chosen.name if chosen is not None else None).runs
