"""Where a request's time went inside vLLM: queued in its scheduler, then computing, per request.

vLLM measures it itself (`FinishedRequestStats`: queued = first SCHEDULED - QUEUED,
prefill = first token - first SCHEDULED, engine-core timestamps) and hands it to
its stat loggers in the step the request finishes. `RequestTimer` is one more
such logger, attached to a running `AsyncLLM`; it keeps the last few thousand
requests' figures until the engine actor takes them (`take`), turned into
`Stamps` on this process's CLOCK_MONOTONIC: the step's end is the moment the
output handler records it, which is when the request's output is queued for
its consumer. For a prefill (max_tokens 1) that is its first and only output.

It also keeps the prompt tokens vLLM computed in that step: several prompts
packed into one step (chunked prefill's token budget) all get their first token
when the whole step ends.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any

from actors.protocol.request import Stamps

logger = logging.getLogger("raypd.vllm")

MAX_KEPT = 4096


class RequestTimer:
    """A duck-typed vLLM stat logger (`record` / `log` / `log_engine_initialized` / `record_sleep_state`)."""

    def __init__(self, max_kept: int = MAX_KEPT, clock: Any = time.monotonic):
        self.max_kept, self.clock = max_kept, clock
        self._done: OrderedDict[str, tuple[tuple[str, float], ...]] = OrderedDict()

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        if iteration_stats is None or not iteration_stats.finished_requests:
            return
        now = self.clock()
        step_tokens = float(getattr(iteration_stats, "num_prompt_tokens", 0) or 0)
        for f in iteration_stats.finished_requests:
            if f.request_id is None:
                continue
            scheduled = now - f.prefill_time - f.decode_time
            self._done[f.request_id] = ((Stamps.VLLM_QUEUED, scheduled - f.queued_time),
                                        (Stamps.VLLM_SCHEDULED, scheduled), (Stamps.VLLM_OUT, now),
                                        (Stamps.VLLM_STEP_TOKENS, step_tokens))
        while len(self._done) > self.max_kept:
            self._done.popitem(last=False)

    def take(self, request_id: str) -> tuple[tuple[str, float], ...]:
        return self._done.pop(request_id, ())

    def log(self) -> None:
        return None

    def log_engine_initialized(self) -> None:
        return None

    def record_sleep_state(self, *args: Any, **kwargs: Any) -> None:
        return None


def timer_for(backend: Any) -> RequestTimer | None:
    """A `RequestTimer` attached to a vLLM backend's running engine; None for other backends
    (or an engine without stats)."""
    manager = getattr(getattr(backend, "llm", None), "logger_manager", None)
    loggers = getattr(manager, "stat_loggers", None)
    if not isinstance(loggers, list):
        return None
    timer = RequestTimer()
    loggers.append(timer)
    return timer
