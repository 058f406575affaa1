"""The EngineActor's prefills whose blocks wait for a reader: `held_leases`, what a drain waits for.

The connector reports how each lease ended (read, expired, released) in the step's connector
stats, which reach this process with vLLM's scheduler stats; an entry ends then, or silently when
no report came by the lease's expiry on this clock (an engine core that died holding it). The same
stats carry a decode engine's failed pulls with the reader ranks' reasons: `PullFailures` counts
them by kind and keeps each request's reason for its ledger verdict; they arrive before the outputs
of any later step. The life cycle of one held prefill: `UnreadLeases`.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from actors.kv.plan.pull_types import FAILURE_KINDS, failure_kind

logger = logging.getLogger("raypd.vllm")

# How a lease ends, as the connector reports it (keys of `LeaseEndStats.data`)
READ, EXPIRED, RELEASED = "read", "expired", "released"
LEASE_ENDS = (READ, EXPIRED, RELEASED)
COUNTERS = {READ: "leases_released_by_notice", EXPIRED: "leases_expired"}
PULL_FAILED = "pull_failed"  # the key of a step's failed pulls: [vLLM's id, why] each


class PullFailures:
    """Why this engine's pulls failed, as its reader ranks said: counted by kind in `counters`
    (`pull_failures_<kind>`, `actors.kv.plan.pull_types.failure_kind`) and kept by request (the last
    `keep`) for the ledger's verdict."""

    KINDS = (*FAILURE_KINDS.values(), "transfer")

    def __init__(self, counters: dict[str, Any], keep: int = 1024):
        self.counters, self.keep = counters, keep
        for kind in self.KINDS:
            counters.setdefault(f"pull_failures_{kind}", 0)
        self._why: OrderedDict[str, str] = OrderedDict()

    def add(self, failed: Iterable[Sequence[str]]) -> None:
        """One step's [vLLM's id, why] entries (vLLM's id is the request's plus a random suffix)."""
        for vllm_id, reason in failed:
            self.counters[f"pull_failures_{failure_kind(reason)}"] += 1
            head, _, suffix = vllm_id.rpartition("-")
            for key in {vllm_id, head if head and len(suffix) == 8 else vllm_id}:
                self._why[key] = reason
                self._why.move_to_end(key)
        while len(self._why) > self.keep:
            self._why.popitem(last=False)

    def reason(self, req_id: str) -> str | None:
        """Why the request's pull failed (None: no failure reported, or long forgotten)."""
        return self._why.get(req_id)


class UnreadLeases:
    """Held prefills by request id, with vLLM's id and the lease's expiry on this process's clock.

    Life cycle of one held prefill, as the actor sees it (`UnreadLeases`):

      remembered  `prefill()` returned transfer params naming vLLM's id of the
                  request: the engine holds its blocks under a lease of `ttl` s;
      read        the readers' notices (an ok=false one, from a reader that gave
                  up, included) released the lease on every producer rank:
                  the connector's scheduler half saw it finished sending and says
                  so in the step's connector stats (`LeaseEndStats`), which vLLM
                  carries to this process with the step's scheduler stats; our
                  stat logger (`lease_ends_logger`) hands them over and the entry
                  ends at once ("leases_released_by_notice");
      expired     no reader finished within the TTL on some rank: reported the
                  same way ("leases_expired");
      released    the actor let go itself (`pop`: abort, nobody will read it); the
                  engine's report of it only confirms;
      timed out   no report came by the lease's expiry on this process's clock (an
                  engine core that died holding it): the entry ends then, silently.
                  The TTL stays the bound for readers that never come.

    The counters count the engine's reports, whichever way the entry ended here
    (an expiry report that comes after the entry timed out still counts).

    The same step stats carry a decode engine's failed pulls with the reader
    ranks' reasons (`PULL_FAILED`); `PullFailures` counts them by kind
    (`pull_failures_lease_ended`: the producer's lease board said the lease had
    ended after the data READ) and keeps each request's reason for its ledger
    verdict. They reach this process before the outputs of any later step, so
    before the request's first token.
    """

    def __init__(self, counters: dict[str, Any], clock: Callable[[], float] = time.monotonic):
        self.counters = counters
        for name in COUNTERS.values():
            counters.setdefault(name, 0)
        self.pull_failures = PullFailures(counters)  # the same stats carry them (a decode engine's)
        self._clock = clock
        self._by_req: dict[str, tuple[str, float]] = {}  # request id -> (vLLM id, expiry)
        self._by_vllm: dict[str, str] = {}  # vLLM id -> request id

    def remember(self, req_id: str, vllm_id: str, ttl_s: float) -> None:
        self.forget_expired()
        self.pop(req_id)
        self._by_req[req_id] = (vllm_id, self._clock() + ttl_s)
        self._by_vllm[vllm_id] = req_id

    def pop(self, req_id: str) -> str | None:
        """vLLM's id of a held prefill the actor releases itself (None when none is held)."""
        entry = self._by_req.pop(req_id, None)
        if entry is None:
            return None
        self._by_vllm.pop(entry[0], None)
        return entry[0]

    def ended(self, report: Mapping[str, Iterable[Any]]) -> None:
        """The engine's report of one step: vLLM ids of ended leases, by how they ended (and the
        failed pulls, handed to `pull_failures`)."""
        self.pull_failures.add(report.get(PULL_FAILED) or ())
        for how in LEASE_ENDS:
            for vllm_id in report.get(how) or ():
                if how in COUNTERS:
                    self.counters[COUNTERS[how]] += 1
                req_id = self._by_vllm.pop(vllm_id, None)
                if req_id is not None:
                    self._by_req.pop(req_id, None)

    def forget_expired(self) -> None:
        now = self._clock()
        for req_id in [r for r, (_, expiry) in self._by_req.items() if expiry <= now]:
            self.pop(req_id)  # no report came: its lease expired anyway, nothing left to release

    def __len__(self) -> int:
        self.forget_expired()
        return len(self._by_req)


def lease_ends_logger(ended: Callable[[Mapping[str, Iterable[str]]], None]):
    """A vLLM stat logger handing each step's lease ends (`SchedulerStats.kv_connector_stats`, as
    the connector's scheduler half reported them) to `ended`, in the AsyncLLM client's process."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class LeaseEndsLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0):
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            report = getattr(scheduler_stats, "kv_connector_stats", None)
            try:
                if isinstance(report, Mapping) and any(report.get(how) for how in (*LEASE_ENDS, PULL_FAILED)):
                    ended(report)
            except Exception:  # noqa: BLE001 - raising here would end AsyncLLM's output handler
                logger.exception("lease ends not applied: %r", report)

        def log_engine_initialized(self) -> None:
            return None

    return LeaseEndsLogger
