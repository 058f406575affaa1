"""What `vllm serve` gives an engine where the operator set neither max_num_batched_tokens nor
max_num_seqs, read from vLLM's own table (`EngineArgs.get_batch_defaults`, by the host's device: its
name and memory, CPU or not) with the OpenAI server's usage context.

raypd's engines are built with that usage context (`usage_context()`, `actors.engine.vllm.backend`),
so vLLM applies those defaults itself; this module answers what they are on this host, for raypd's
own decisions (whether a measured chunk budget beats vLLM's, the budget assumed for an engine that
published none). vLLM is imported when asked, never at import.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BatchDefaults:
    """vLLM's max_num_batched_tokens and max_num_seqs for an engine that sets neither."""

    max_num_batched_tokens: int
    max_num_seqs: int


def usage_context() -> Any:
    """The usage context raypd builds its engines with: `vllm serve`'s (raypd serves the OpenAI API)."""
    from vllm.usage.usage_lib import UsageContext

    return UsageContext.OPENAI_API_SERVER


@functools.lru_cache(maxsize=None)
def _table(world_size: int) -> BatchDefaults:
    from vllm.config import SchedulerConfig
    from vllm.engine.arg_utils import EngineArgs

    tokens, seqs = EngineArgs.get_batch_defaults(world_size)
    context = usage_context()
    return BatchDefaults(tokens.get(context, SchedulerConfig.DEFAULT_MAX_NUM_BATCHED_TOKENS),
                         seqs.get(context, SchedulerConfig.DEFAULT_MAX_NUM_SEQS))


def serve_batch_defaults(world_size: int = 1, performance_mode: str | None = None) -> BatchDefaults:
    """`vllm serve`'s defaults on this host for an engine of `world_size` ranks (TP x PP), doubled by
    `performance_mode: throughput` as vLLM doubles them."""
    table = _table(world_size)
    factor = 2 if performance_mode == "throughput" else 1
    return BatchDefaults(table.max_num_batched_tokens * factor, table.max_num_seqs * factor)


def clear_cache() -> None:
    """Forget the table read (tests that stand another device in for the host's)."""
    _table.cache_clear()
