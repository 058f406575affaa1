"""vLLM's scheduler with one rule added: a step in which a stream is owed its second token carries no
prefill chunk.

Why: vLLM schedules a prompt queued behind a stream's own prefill in the very next step, so that
stream's second token waits for a whole chunk. On a one-core CPU engine a 128-token chunk is a step
of about 0.5 s against a 60 ms decode step; under load half of raypd's streams waited that long for
their second token (docs/placement.md, "A stream's second token"). The router already keeps new
prompts away from such streams when another engine can take them; this covers the prompts that
were queued there before.

How: vLLM's own prefill deferral (`throttle_prefills`, its data-parallel prefill balancing) runs the
step's decodes and defers in-progress chunks and new prefills to the next step; vLLM overrides it
when the engine is saturated with waiting prompts. Invariants: a deferral costs the deferred
prompts one decode step; each stream causes at most one (a stream is owed its second token for one
step); nothing else of the scheduler changes (every method but `schedule` is vLLM's).

Used as vLLM's `scheduler_cls` where the engine runs vLLM's synchronous scheduler: raypd's CPU
engines (`serving.config`). A GPU engine keeps vLLM's async scheduler, which a `Scheduler` subclass
would turn off.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler

QUALNAME = f"{__name__}.SecondTokenScheduler"


class _Running(Protocol):
    is_prefill_chunk: bool

    @property
    def num_output_tokens(self) -> int: ...


def owes_second_token(running: Iterable[_Running]) -> bool:
    """Whether a running request has its first token and is decoding its second this step."""
    return any(r.num_output_tokens == 1 and not r.is_prefill_chunk for r in running)


class SecondTokenScheduler(Scheduler):
    """vLLM's `Scheduler`; a step where a stream is owed its second token defers prefill chunks."""

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        return super().schedule(throttle_prefills or owes_second_token(self.running))
