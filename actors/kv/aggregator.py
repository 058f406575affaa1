"""Fold per-rank KV connector outputs into one verdict per engine step.

Every worker rank of an engine reports, each step, which requests it finished sending or
receiving, which blocks it could not load, and which receives failed. Invariant: a request has
finished a transfer only once *every* participating rank has said so (`expected_finished_count`
ranks, counted across steps), and a failed receive is reported only with that finish. Semantics
follow vLLM's `KVOutputAggregator`; raypd's additions (outputs of a dead rank stashed and replayed,
`forget`, `pending`) and differences: `KVOutputAggregator`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from actors.kv.transfer_errors import AggregationError

logger = logging.getLogger("raypd.aggregator")


@dataclass
class KVConnectorOutput:
    """What one rank (or the aggregate of all ranks) reports for one step."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    # 0 = "no opinion"; > 0 = this many ranks must report a request finished.
    expected_finished_count: int = 0
    stats: dict[str, float] = field(default_factory=dict)
    # Opaque to the aggregator (prefix-cache events); the aggregate carries a
    # tuple of the live ranks' event objects, in rank order, or None.
    kv_cache_events: object | None = None
    # why a failed receive failed (request -> reason), when the rank knows
    failure_reasons: dict[str, str] = field(default_factory=dict)

    def is_empty(self) -> bool:
        """True when the output carries nothing the scheduler must act on."""
        return not (
            self.finished_sending
            or self.finished_recving
            or self.invalid_block_ids
            or self.failed_recving
            or self.stats
            or self.kv_cache_events is not None
            or self.failure_reasons
        )


@dataclass(frozen=True)
class PendingTransfers:
    """Diagnostics: request ids still waiting for more ranks to report."""

    sending: dict[str, int]  # req_id -> ranks still to report
    recving: dict[str, int]
    failed_recving: frozenset[str]  # failed, waiting for their recv to finish
    salvaged_outputs: int  # stashed outputs of failed ranks awaiting replay

    def is_empty(self) -> bool:
        return not (self.sending or self.recving or self.failed_recving or self.salvaged_outputs)


def _check_count(value: object, what: str, *, allow_zero: bool) -> int:
    # bool is an int subclass; True as a rank count is always a bug upstream.
    if isinstance(value, bool) or not isinstance(value, int):
        raise AggregationError(f"{what} must be an int, got {type(value).__name__}")
    floor = 0 if allow_zero else 1
    if value < floor:
        raise AggregationError(f"{what} must be >= {floor}, got {value}")
    return value


def _check_output(index: int, output: object) -> None:
    """Reject a malformed output before any state changes (all-or-nothing)."""
    if output is None:
        return
    if not isinstance(output, KVConnectorOutput):
        raise AggregationError(
            f"output {index} must be KVConnectorOutput or None, got {type(output).__name__}"
        )
    for name in ("finished_sending", "finished_recving", "invalid_block_ids", "failed_recving"):
        if not isinstance(getattr(output, name), (set, frozenset)):
            raise AggregationError(f"output {index} {name} must be a set")
    _check_count(output.expected_finished_count, f"output {index} expected_finished_count",
                 allow_zero=True)
    if not isinstance(output.failure_reasons, dict):
        raise AggregationError(f"output {index} failure_reasons must be a dict")
    for key, value in output.stats.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise AggregationError(f"output {index} stat {key!r} is not a number: {value!r}")


class KVOutputAggregator:
    """Turns per-rank `KVConnectorOutput`s into one output per step.

    Not thread-safe: it lives in the scheduler loop, which calls it serially.

    Semantics follow vLLM's `KVOutputAggregator`:

    - sending and receiving are counted separately, per request id;
    - a rank may announce a new `expected_finished_count` (> 0); it applies to
      request ids first seen after the change, in-flight ids keep their count;
    - invalid block ids are unioned;
    - a failed receive is held back until the same request finishes receiving on
      all ranks, then reported together with that finish (the scheduler decides
      recompute vs. error only once no rank still writes into those blocks),
      with why it failed when a rank said so (`failure_reasons`, raypd's: the
      first rank's reason);
    - outputs of a rank that died mid-step can be stashed with
      `ft_defer_kv_connector_outputs` and are replayed by the next `aggregate`,
      so their transfer progress is not lost. This one is raypd's, for the
      synthetic engine (whose ranks are separate actors and outlive one another):
      vLLM 0.32's aggregator has no such deferral, and a vLLM worker that dies
      takes its engine core down with it (README, "Why there is no salvage on vLLM").

    raypd's shape of it: `aggregate` takes the per-rank `KVConnectorOutput`s
    themselves (vLLM wraps them in its ModelRunnerOutput, a type this package
    does not import) and returns the aggregate with empty sets rather than None;
    stats are summed per key and kv_cache_events collected in rank order.
    Additions: `forget()` drops an aborted request's counters (no leaks) and
    `pending()` shows what is still waiting.
    """

    def __init__(self, expected_finished_count: int):
        self._expected = _check_count(expected_finished_count, "expected_finished_count",
                                      allow_zero=False)
        # req_id -> ranks that still have to report; the count is fixed when
        # the id is first seen so a later expected-count change cannot strand it.
        self._send_remaining: dict[str, int] = {}
        self._recv_remaining: dict[str, int] = {}
        self._failed_recving_pending: set[str] = set()
        self._reasons: dict[str, str] = {}  # of pending failed receives
        self._salvaged: list[KVConnectorOutput] = []

    @classmethod
    def from_connector(cls, connector: object, world_size: int) -> "KVOutputAggregator":
        """Expect the connector's own finished count (`get_finished_count()`), else every rank."""
        get_count = getattr(connector, "get_finished_count", None)
        return cls((get_count() if callable(get_count) else None) or world_size)

    @property
    def expected_finished_count(self) -> int:
        return self._expected

    def aggregate(self, per_rank_outputs: list[KVConnectorOutput | None]) -> KVConnectorOutput:
        """Fold this step's per-rank outputs (plus any salvaged ones) into one.

        `None` entries are ranks with nothing to report. Raises
        `AggregationError` (state untouched) if an entry is malformed.
        """
        outputs = list(per_rank_outputs)
        for index, output in enumerate(outputs):
            _check_output(index, output)

        salvaged, self._salvaged = self._salvaged, []
        finished_sending: set[str] = set()
        finished_recving: set[str] = set()
        invalid_block_ids: set[int] = set()
        stats: dict[str, float] = {}
        events: list[object] = []

        # Salvaged outputs go first: they belong to an earlier step.
        for output in [*salvaged, *outputs]:
            if output is None:
                continue
            self._maybe_update_expected(output.expected_finished_count)
            self._count(output.finished_sending, self._send_remaining, finished_sending)
            self._count(output.finished_recving, self._recv_remaining, finished_recving)
            invalid_block_ids |= output.invalid_block_ids
            self._failed_recving_pending |= output.failed_recving
            for req_id, reason in output.failure_reasons.items():
                if req_id in self._failed_recving_pending:
                    self._reasons.setdefault(req_id, reason)
            for key, value in output.stats.items():
                stats[key] = stats.get(key, 0) + value
            if output.kv_cache_events is not None:
                events.append(output.kv_cache_events)

        failed_recving = self._failed_recving_pending & finished_recving
        self._failed_recving_pending -= failed_recving
        reasons = {r: self._reasons.pop(r) for r in failed_recving if r in self._reasons}

        return KVConnectorOutput(
            finished_sending=finished_sending,
            finished_recving=finished_recving,
            invalid_block_ids=invalid_block_ids,
            failed_recving=failed_recving,
            expected_finished_count=self._expected,
            stats=stats,
            kv_cache_events=tuple(events) if events else None,
            failure_reasons=reasons,
        )

    def ft_defer_kv_connector_outputs(self, kv_connector_outputs: Iterable[KVConnectorOutput | None]) -> None:
        """Stash KV connector outputs from failed workers for replay at the next aggregate().

        kv_cache_events are dropped (set to None on the outputs themselves, as
        the reference does): replaying them could break the live workers' event
        quorum, and a missed event only costs a cache miss.
        """
        batch = list(kv_connector_outputs)
        for index, output in enumerate(batch):
            _check_output(index, output)
        for output in batch:
            if output is not None:
                output.kv_cache_events = None
        self._salvaged.extend(output for output in batch if output)

    def forget(self, req_id: str) -> bool:
        """Drop every trace of an aborted request; True if anything was held.

        Also scrubs stashed outputs, otherwise their replay would start a new
        counter for the id that nothing would ever complete.
        """
        found = False
        for table in (self._send_remaining, self._recv_remaining):
            found |= table.pop(req_id, None) is not None
        if req_id in self._failed_recving_pending:
            self._failed_recving_pending.discard(req_id)
            found = True
        self._reasons.pop(req_id, None)
        scrubbed: list[KVConnectorOutput] = []
        for output in self._salvaged:
            if req_id in output.finished_sending or req_id in output.finished_recving \
                    or req_id in output.failed_recving:
                found = True
                output = dataclasses.replace(
                    output,
                    finished_sending=output.finished_sending - {req_id},
                    finished_recving=output.finished_recving - {req_id},
                    failed_recving=output.failed_recving - {req_id},
                )
            scrubbed.append(output)
        self._salvaged = scrubbed
        return found

    def pending(self) -> PendingTransfers:
        """Snapshot of ids still waiting for ranks (copies; safe to keep)."""
        return PendingTransfers(
            sending=dict(self._send_remaining),
            recving=dict(self._recv_remaining),
            failed_recving=frozenset(self._failed_recving_pending),
            salvaged_outputs=len(self._salvaged),
        )

    def _maybe_update_expected(self, announced: int) -> None:
        # A rank may change how many ranks must report (e.g. a connector whose
        # finished count differs from the world size); 0 means "no opinion".
        if announced > 0 and announced != self._expected:
            logger.debug("expected finished count updated from %d to %d",
                         self._expected, announced)
            self._expected = announced

    def _count(self, req_ids: set[str], remaining: dict[str, int], finished: set[str]) -> None:
        for req_id in req_ids:
            left = remaining.get(req_id, self._expected) - 1
            if left <= 0:
                remaining.pop(req_id, None)
                finished.add(req_id)
            else:
                remaining[req_id] = left
