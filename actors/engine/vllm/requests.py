"""One request's way into vLLM: its prompt checked, its sampling parameters, its outputs.

  prompt_ids       the token ids the front tokenized (checked again for direct callers);
  base_params      vLLM's `SamplingParams` as the front derived them (pickled in
                   `SamplingSpec.vllm_params`); `stream_params` streams them as deltas
                   carrying the KV transfer params at vLLM's own boundary (`extra_args`);
                   `sampling_params` both, for a prefill;
  logprobs_of      vLLM's logprobs as typed wire objects (`TokenLogprob`);
  engine_outputs   `AsyncLLM.generate`, with what vLLM refuses while admitting the
                   request (vocabulary, length, sampling) turned into `EngineRequestError`
                   (the client's fault: a 400, never an engine failure);
  usage_sink       a vLLM stat logger keeping the scheduler's last view (KV usage, queues)
                   and vLLM's own counts of where prompt tokens came from.
"""

from __future__ import annotations

import pickle
from collections.abc import AsyncIterator
from typing import Any

from actors.protocol.request import EngineRequest, EngineRequestError, Logprobs, SamplingSpec, TokenLogprob


def prompt_ids(req: EngineRequest, max_model_len: int) -> list[int]:
    """The token ids (the front tokenized and checked them; this guards direct callers)."""
    ids = list(req.prompt_token_ids)
    if not ids:
        raise EngineRequestError("the prompt is empty")
    if len(ids) + req.max_tokens > max_model_len:
        raise EngineRequestError(
            f"prompt ({len(ids)} tokens) + max_tokens ({req.max_tokens}) exceeds the context length "
            f"{max_model_len}"
        )
    return ids


def base_params(spec: SamplingSpec) -> Any:
    """A fresh copy of vLLM's SamplingParams as the front derived them (pickled in the spec)."""
    from vllm import SamplingParams

    if spec.vllm_params is not None:
        return pickle.loads(spec.vllm_params)
    try:  # a direct caller (tests, benchmarks) that only set the plain fields
        return SamplingParams(temperature=0.0 if spec.temperature is None else spec.temperature,
                              top_p=1.0 if spec.top_p is None else spec.top_p, seed=spec.seed,
                              stop=list(spec.stop) or None, ignore_eos=spec.ignore_eos)
    except (ValueError, TypeError) as exc:  # vLLM refuses the sampling parameters
        raise EngineRequestError(str(exc)) from None


def stream_params(sp: Any, kv_params: dict | None) -> Any:
    """`sp` streamed as deltas, carrying our transfer params (vLLM's own boundary: `extra_args`)."""
    from vllm.sampling_params import RequestOutputKind

    sp.output_kind = RequestOutputKind.DELTA
    extra = {k: v for k, v in (sp.extra_args or {}).items() if k != "kv_transfer_params"}
    if kv_params:
        extra["kv_transfer_params"] = kv_params
    sp.extra_args = extra or None
    return sp


def sampling_params(spec: SamplingSpec, max_tokens: int, kv_params: dict | None) -> Any:
    """vLLM's SamplingParams as the front derived them, `max_tokens` of them, streamed as deltas."""
    sp = base_params(spec)
    sp.max_tokens = max_tokens
    sp.min_tokens = min(sp.min_tokens, max_tokens)
    return stream_params(sp, kv_params)


def logprobs_of(lps: Any) -> Logprobs | None:
    """vLLM's per-token logprobs (dicts or FlatLogprobs) as typed wire objects."""
    if lps is None:
        return None
    return tuple(tuple(TokenLogprob(int(t), float(lp.logprob), lp.rank, lp.decoded_token)
                       for t, lp in (pos or {}).items()) for pos in lps)


async def engine_outputs(llm: Any, ids: list[int], sp: Any, request_id: str) -> AsyncIterator[Any]:
    """AsyncLLM.generate; what vLLM refuses while admitting the request (vocabulary, length,
    sampling parameters) is the client's fault. vLLM wraps admission errors other than its
    client errors in EngineGenerateError."""
    from vllm.exceptions import VLLMClientError
    from vllm.v1.engine.exceptions import EngineGenerateError

    admitted = False
    try:
        async for out in llm.generate({"prompt_token_ids": ids}, sp, request_id=request_id):
            admitted = True
            yield out
    except VLLMClientError as exc:
        raise EngineRequestError(str(exc)) from None
    except (EngineGenerateError, ValueError, TypeError) as exc:
        cause = exc.__cause__ if isinstance(exc, EngineGenerateError) else exc
        if not admitted and isinstance(cause, (ValueError, TypeError)):
            raise EngineRequestError(str(cause)) from None
        raise


def usage_sink(sink: dict):
    """A vLLM stat logger that keeps the last scheduler stats (KV usage, queues) and sums what
    the engine's prompt tokens came from (computed here, pulled, local prefix cache) and, with
    vLLM's `enable_logging_iteration_details`, the steps that computed tokens."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    for key in ("prompt_tokens", "prompt_tokens_computed", "prompt_tokens_pulled", "prompt_tokens_cached",
                "compute_steps", "compute_steps_ctx_tokens", "compute_steps_gen_tokens", "core_outputs"):
        sink.setdefault(key, 0)

    class KVUsageLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0):
            sink["num_blocks"] = vllm_config.cache_config.num_gpu_blocks or 0

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                sink["core_outputs"] += 1  # one per engine-core step seen here: the liveness probe's progress
                sink["kv_cache_usage"] = scheduler_stats.kv_cache_usage
                sink["running"] = scheduler_stats.num_running_reqs
                sink["waiting"] = scheduler_stats.num_waiting_reqs
                step = getattr(scheduler_stats, "iteration_details", None)
                if step is not None and not step.is_dummy:
                    sink["compute_steps"] += 1
                    sink["compute_steps_ctx_tokens"] += step.num_ctx_tokens
                    sink["compute_steps_gen_tokens"] += step.num_generation_tokens
            prompt = getattr(iteration_stats, "prompt_token_stats", None)
            if prompt is not None:
                sink["prompt_tokens"] += prompt.total
                sink["prompt_tokens_computed"] += prompt.computed
                sink["prompt_tokens_pulled"] += prompt.external_kv_transfer
                sink["prompt_tokens_cached"] += prompt.local_cache_hit

        def log_engine_initialized(self) -> None:
            return None

    return KVUsageLogger
