"""CircuitBreaker transitions under a fake clock (never sleeps)."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.control.breaker import CircuitBreaker
from actors.kv.transfer_errors import BreakerConfigError, KVTransferError


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


COOLDOWN, THRESHOLD, WINDOW = 10.0, 3, 2.0


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def breaker(clock: FakeClock) -> CircuitBreaker:
    return CircuitBreaker("peer-a", cooldown_s=COOLDOWN, failure_threshold=THRESHOLD,
                          probe_window_s=WINDOW, clock=clock)


def trip(breaker: CircuitBreaker) -> None:
    for _ in range(THRESHOLD):
        breaker.record_failure()


# -- configuration -----------------------------------------------------------------

@pytest.mark.parametrize("kwargs", [
    {"cooldown_s": 0}, {"cooldown_s": -1.0}, {"cooldown_s": float("inf")},
    {"cooldown_s": float("nan")}, {"probe_window_s": 0}, {"probe_window_s": -0.1},
    {"failure_threshold": 0}, {"failure_threshold": -2}, {"failure_threshold": 1.5},
    {"failure_threshold": True}, {"name": ""}, {"clock": "not callable"},
])
def test_bad_parameters_rejected(kwargs):
    params = {"name": "p", "cooldown_s": 1.0, "failure_threshold": 1, "probe_window_s": 1.0}
    params.update(kwargs)
    with pytest.raises(BreakerConfigError):
        CircuitBreaker(**params)


def test_config_error_is_typed_value_error():
    assert issubclass(BreakerConfigError, ValueError)
    assert issubclass(BreakerConfigError, KVTransferError)


# -- closed -> open ----------------------------------------------------------------

def test_starts_closed(breaker):
    assert breaker.state == "closed"
    assert not breaker.is_open
    assert breaker.allow()


def test_opens_after_threshold_consecutive_failures(breaker):
    for _ in range(THRESHOLD - 1):
        breaker.record_failure()
        assert breaker.state == "closed"
        assert breaker.allow()
    breaker.record_failure()
    assert breaker.state == "open"
    assert breaker.is_open
    assert breaker.opened_count == 1


def test_success_resets_consecutive_count(breaker):
    for _ in range(THRESHOLD - 1):
        breaker.record_failure()
    breaker.record_success()
    assert breaker.consecutive_failures == 0
    for _ in range(THRESHOLD - 1):
        breaker.record_failure()
    assert breaker.state == "closed"  # 2 + 2 failures, never 3 in a row
    breaker.record_failure()
    assert breaker.state == "open"


def test_open_rejects_until_cooldown(breaker, clock):
    trip(breaker)
    assert not breaker.allow()
    clock.advance(COOLDOWN - 0.001)
    assert not breaker.allow()
    assert breaker.state == "open"
    assert breaker.rejections == 2
    assert breaker.probes_admitted == 0


# -- half-open probing -------------------------------------------------------------

def test_cooldown_admits_single_probe_and_holds_others(breaker, clock):
    trip(breaker)
    clock.advance(COOLDOWN)
    assert breaker.state == "half_open"
    assert not breaker.is_open  # nobody probing yet: next allow() will pass
    assert breaker.allow() is True  # the probe
    assert breaker.probes_admitted == 1
    assert breaker.is_open  # probe in flight: others are held
    clock.advance(WINDOW - 0.001)
    assert breaker.allow() is False
    assert breaker.allow() is False
    assert breaker.state == "half_open"
    assert breaker.rejections == 2
    assert breaker.probes_admitted == 1


def test_probe_success_closes(breaker, clock):
    trip(breaker)
    clock.advance(COOLDOWN)
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state == "closed"
    assert breaker.closed_count == 1
    assert breaker.consecutive_failures == 0
    assert all(breaker.allow() for _ in range(5))
    # A fresh run of failures is needed to reopen.
    breaker.record_failure()
    assert breaker.state == "closed"


def test_probe_failure_reopens_for_full_cooldown(breaker, clock):
    trip(breaker)
    clock.advance(COOLDOWN)
    assert breaker.allow()
    clock.advance(1.0)
    breaker.record_failure()  # a single failure suffices while half-open
    assert breaker.state == "open"
    assert breaker.opened_count == 2
    clock.advance(COOLDOWN - 0.001)
    assert not breaker.allow()
    clock.advance(0.001)
    assert breaker.allow()
    assert breaker.probes_admitted == 2


def test_unreported_probe_lets_next_caller_probe_after_window(breaker, clock):
    trip(breaker)
    clock.advance(COOLDOWN)
    assert breaker.allow()  # probe 1 never reports
    clock.advance(WINDOW)
    assert breaker.allow() is True  # probe 2
    assert breaker.allow() is False  # held again behind probe 2
    assert breaker.probes_admitted == 2
    breaker.record_success()
    assert breaker.state == "closed"


def test_late_failure_while_open_restarts_cooldown(breaker, clock):
    trip(breaker)
    clock.advance(COOLDOWN / 2)
    breaker.record_failure()  # straggler admitted before the breaker opened
    clock.advance(COOLDOWN / 2)
    assert not breaker.allow()
    assert breaker.opened_count == 1  # an extension, not a new opening
    clock.advance(COOLDOWN / 2)
    assert breaker.allow()


def test_success_while_open_closes(breaker):
    trip(breaker)
    breaker.record_success()  # straggler proves the peer works
    assert breaker.state == "closed"
    assert breaker.allow()


# -- observability -------------------------------------------------------------------

def test_counters_follow_transitions(breaker, clock):
    seen = [breaker.state]
    trip(breaker)
    seen.append(breaker.state)
    clock.advance(COOLDOWN)
    seen.append(breaker.state)
    breaker.allow()
    breaker.record_failure()
    seen.append(breaker.state)
    clock.advance(COOLDOWN)
    breaker.allow()
    breaker.record_success()
    seen.append(breaker.state)
    assert seen == ["closed", "open", "half_open", "open", "closed"]
    assert (breaker.opened_count, breaker.closed_count, breaker.probes_admitted) == (2, 1, 2)


def test_state_changes_are_logged(breaker, clock, caplog):
    with caplog.at_level(logging.INFO, logger="raypd.breaker"):
        trip(breaker)
        clock.advance(COOLDOWN)
        breaker.allow()
        breaker.record_success()
    messages = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "raypd.breaker"]
    assert any(level == logging.WARNING and "peer-a" in m and "opened" in m
               for level, m in messages)
    assert any("closed" in m for _, m in messages)


def test_snapshot_is_plain_dict(breaker, clock):
    trip(breaker)
    clock.advance(4.0)
    breaker.allow()
    snap = breaker.snapshot()
    assert snap == {
        "name": "peer-a",
        "state": "open",
        "consecutive_failures": 3,
        "failure_threshold": THRESHOLD,
        "cooldown_s": COOLDOWN,
        "probe_window_s": WINDOW,
        "retry_in_s": pytest.approx(6.0),
        "probe_in_flight": False,
        "opened_count": 1,
        "closed_count": 0,
        "probes_admitted": 0,
        "rejections": 1,
    }
    clock.advance(6.0)
    breaker.allow()
    snap = breaker.snapshot()
    assert snap["state"] == "half_open"
    assert snap["probe_in_flight"] is True
    assert snap["retry_in_s"] == 0.0


# -- the reference's semantics ---------------------------------------------------------

class ReferenceModel:
    """The customer's reference breaker, restated with an injected clock (test oracle)."""

    def __init__(self, clock, cooldown_s, failure_threshold, probe_window_s):
        self.clock, self.cooldown, self.threshold, self.window = clock, cooldown_s, failure_threshold, probe_window_s
        self.failures, self.open_until = 0, 0.0

    @property
    def is_open(self):
        return self.clock() < self.open_until

    def allow(self):
        now = self.clock()
        if now < self.open_until:
            return False
        if self.failures >= self.threshold:
            self.open_until = now + self.window  # this caller is the probe
        return True

    def record_failure(self):
        self.failures += 1
        if self.failures >= self.threshold:
            self.open_until = self.clock() + self.cooldown

    def record_success(self):
        self.failures, self.open_until = 0, 0.0


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 4), st.lists(st.tuples(st.sampled_from(["allow", "fail", "ok", "is_open"]),
                                             st.sampled_from([0.0, 0.5, 1.0, 2.0, 5.0, 9.9, 10.0, 12.0])),
                                   max_size=80))
def test_every_decision_matches_the_reference(threshold, ops):
    clock = FakeClock()
    ours = CircuitBreaker("p", cooldown_s=COOLDOWN, failure_threshold=threshold, probe_window_s=WINDOW,
                          clock=clock)
    ref = ReferenceModel(clock, COOLDOWN, threshold, WINDOW)
    for op, dt in ops:
        clock.advance(dt)
        if op == "allow":
            assert ours.allow() == ref.allow()
        elif op == "fail":
            ours.record_failure()
            ref.record_failure()
        elif op == "ok":
            ours.record_success()
            ref.record_success()
        assert ours.is_open == ref.is_open
        assert ours.consecutive_failures == ref.failures


# -- property: at most one probe per window ------------------------------------------

@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["allow", "fail", "ok"]),
                          st.floats(0, 3 * COOLDOWN)), max_size=60))
def test_never_more_than_one_probe_per_window(ops):
    clock = FakeClock()
    breaker = CircuitBreaker("p", cooldown_s=COOLDOWN, failure_threshold=2,
                             probe_window_s=WINDOW, clock=clock)
    last_probe_at: float | None = None
    for op, dt in ops:
        clock.advance(dt)
        state_before = breaker.state
        if op == "allow":
            probes_before = breaker.probes_admitted
            allowed = breaker.allow()
            if state_before == "open":
                assert not allowed
            if state_before == "half_open" and last_probe_at is not None:
                # A probe is out and unreported: held inside the window only.
                assert allowed == (clock.now - last_probe_at >= WINDOW)
            if breaker.probes_admitted > probes_before:
                assert allowed and state_before == "half_open"
                last_probe_at = clock.now
            if state_before == "closed":
                assert allowed
        elif op == "fail":
            breaker.record_failure()
            last_probe_at = None
            assert breaker.state in ("closed", "open")
        else:
            breaker.record_success()
            last_probe_at = None
            assert breaker.state == "closed"
