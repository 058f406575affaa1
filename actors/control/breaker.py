"""Per-peer circuit breaker (closed -> open -> half_open -> closed), one per (prefill, decode) pair.

After `failure_threshold` consecutive transfer failures the peer is skipped for `cooldown_s`; then
`allow()` admits exactly one probe within `probe_window_s`. Semantics follow vLLM's
`CircuitBreaker`, including its two lenient rules (a success in any state closes it; a failure while
open restarts the cooldown). The states are `actors.routes.BreakerState`. The clock is injected, so
every transition is testable without sleeping; state changes are logged on "raypd.breaker" and
counted. The transitions: `CircuitBreaker`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from actors.kv.transfer_errors import BreakerConfigError
from actors.routes import BreakerState

logger = logging.getLogger("raypd.breaker")

CLOSED, HALF_OPEN, OPEN = BreakerState.CLOSED, BreakerState.HALF_OPEN, BreakerState.OPEN


def _positive_seconds(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BreakerConfigError(f"{what} must be a number, got {type(value).__name__}")
    # An infinite cooldown would never recover; NaN compares false everywhere.
    if not math.isfinite(value) or value <= 0:
        raise BreakerConfigError(f"{what} must be a finite number > 0, got {value!r}")
    return float(value)


class CircuitBreaker:
    """Breaker guarding one peer.

    No lock: breakers live in the coordinator's ledger and in the router, each
    used from one asyncio event loop, so calls never interleave.

    A decode engine keeps one breaker per prefill peer: after `failure_threshold`
    consecutive transfer failures the peer is skipped for `cooldown_s`. Once the
    cooldown has passed, `allow()` admits exactly one probe and holds everyone else
    for `probe_window_s`:

    - the probe fails -> open again for `cooldown_s`;
    - the probe succeeds -> closed, failure count reset;
    - the probe never reports back -> after `probe_window_s` the next caller probes.

    Semantics follow vLLM's `CircuitBreaker`, including its two lenient rules:
    a success reported in any state closes the breaker (the peer demonstrably
    works), and a failure reported while open restarts the cooldown.

    The clock is injected (`clock=`) so every transition is testable without
    sleeping. State changes are logged on "raypd.breaker" and counted; `snapshot()` gives
    a plain dict for status pages and metrics.
    """

    def __init__(
        self,
        name: str,
        cooldown_s: float,
        failure_threshold: int,
        probe_window_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not isinstance(name, str) or not name:
            raise BreakerConfigError("name must be a non-empty str")
        if isinstance(failure_threshold, bool) or not isinstance(failure_threshold, int):
            raise BreakerConfigError(
                f"failure_threshold must be an int, got {type(failure_threshold).__name__}")
        if failure_threshold <= 0:
            raise BreakerConfigError(f"failure_threshold must be > 0, got {failure_threshold}")
        if not callable(clock):
            raise BreakerConfigError("clock must be callable")
        self.name = name
        self.cooldown_s = _positive_seconds(cooldown_s, "cooldown_s")
        self.failure_threshold = failure_threshold
        self.probe_window_s = _positive_seconds(probe_window_s, "probe_window_s")
        self._clock = clock

        self._state: BreakerState = CLOSED
        self._failures = 0
        self._open_until = 0.0
        self._probe_deadline: float | None = None  # set while a probe is out

        self.opened_count = 0
        self.closed_count = 0
        self.probes_admitted = 0
        self.rejections = 0

    # -- observation -------------------------------------------------------

    @property
    def state(self) -> BreakerState:
        """Current state; an elapsed cooldown reads as "half_open"."""
        self._advance(self._clock())
        return self._state

    @property
    def is_open(self) -> bool:
        """True when `allow()` would refuse right now (cooling down, or a probe is out)."""
        now = self._clock()
        self._advance(now)
        return self._state == OPEN or self._probe_in_flight(now)

    @property
    def consecutive_failures(self) -> int:
        return self._failures

    def snapshot(self) -> dict[str, Any]:
        """Plain-dict view for status endpoints and metrics exporters."""
        now = self._clock()
        self._advance(now)
        return {
            "name": self.name,
            "state": self._state,
            "consecutive_failures": self._failures,
            "failure_threshold": self.failure_threshold,
            "cooldown_s": self.cooldown_s,
            "probe_window_s": self.probe_window_s,
            "retry_in_s": max(0.0, self._open_until - now) if self._state == OPEN else 0.0,
            "probe_in_flight": self._probe_in_flight(now),
            "opened_count": self.opened_count,
            "closed_count": self.closed_count,
            "probes_admitted": self.probes_admitted,
            "rejections": self.rejections,
        }

    # -- decisions ---------------------------------------------------------

    def allow(self) -> bool:
        """May the caller send a request to this peer now?"""
        now = self._clock()
        self._advance(now)
        if self._state == CLOSED:
            return True
        if self._state == HALF_OPEN and not self._probe_in_flight(now):
            # First caller after the cooldown (or after an unreported
            # probe's window) becomes the probe; others wait for its verdict.
            self._probe_deadline = now + self.probe_window_s
            self.probes_admitted += 1
            logger.info("%s circuit breaker admitted a probe", self.name)
            return True
        self.rejections += 1
        return False

    def record_failure(self) -> None:
        now = self._clock()
        self._advance(now)
        self._failures += 1
        if self._state == HALF_OPEN:
            # The probe (or a straggler) failed: the peer is still sick.
            self._open(now, reason="probe failed")
        elif self._state == OPEN:
            # Late failure of a request admitted earlier: restart the cooldown.
            self._open_until = now + self.cooldown_s
        elif self._failures >= self.failure_threshold:
            self._open(now, reason=f"{self._failures} consecutive failures")

    def record_success(self) -> None:
        self._advance(self._clock())
        self._failures = 0
        self._open_until = 0.0
        self._probe_deadline = None
        if self._state != CLOSED:
            self.closed_count += 1
            self._transition(CLOSED)
            logger.info("%s circuit breaker closed", self.name)

    # -- internals -----------------------------------------------------------

    def _probe_in_flight(self, now: float) -> bool:
        return (
            self._state == HALF_OPEN
            and self._probe_deadline is not None
            and now < self._probe_deadline
        )

    def _advance(self, now: float) -> None:
        # Time alone moves open -> half_open; every observer applies it so
        # state, snapshot and allow() never disagree.
        if self._state == OPEN and now >= self._open_until:
            self._probe_deadline = None
            self._transition(HALF_OPEN)
            logger.info("%s circuit breaker cooldown over; next request probes", self.name)

    def _open(self, now: float, reason: str) -> None:
        self._open_until = now + self.cooldown_s
        self._probe_deadline = None
        self.opened_count += 1
        self._transition(OPEN)
        logger.warning("%s circuit breaker opened (%s); skipping requests for %s s",
                       self.name, reason, self.cooldown_s)

    def _transition(self, new: BreakerState) -> None:
        self._state = new
