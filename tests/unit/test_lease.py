"""LeaseTable: producer-side block leases under a fake clock (never sleeps)."""

from __future__ import annotations


import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.kv.transfer_errors import KVTransferError, LeaseError
from actors.kv.lease.lease import Lease, LeaseTable


class FakeClock:
    def __init__(self, now: float = 500.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def table(clock: FakeClock) -> LeaseTable:
    return LeaseTable(clock=clock)


# -- grant ------------------------------------------------------------------------------

def test_grant_returns_lease(table, clock):
    lease = table.grant("r1", [4, 5, 6], readers=2, ttl_s=30.0)
    assert lease == Lease("r1", (4, 5, 6), 2, frozenset(), clock.now + 30.0)
    assert lease.readers_remaining == 2
    assert table.get("r1") == lease
    assert table.held() == 1
    assert table.counters()["held_blocks"] == 3


def test_grant_copies_block_ids(table):
    ids = [1, 2]
    table.grant("r1", ids, readers=1, ttl_s=1.0)
    ids.append(3)
    assert table.get("r1").block_ids == (1, 2)


@pytest.mark.parametrize("kwargs", [
    {"readers": 0}, {"readers": -1}, {"readers": True}, {"readers": 1.0},
    {"ttl_s": 0}, {"ttl_s": -5.0}, {"ttl_s": float("nan")}, {"ttl_s": float("inf")},
    {"req_id": ""}, {"req_id": 7},
    {"block_ids": [1, -2]}, {"block_ids": [1, "2"]}, {"block_ids": 5}, {"block_ids": [True]},
])
def test_grant_rejects_bad_arguments(table, kwargs):
    params = {"req_id": "r", "block_ids": [1], "readers": 1, "ttl_s": 1.0}
    params.update(kwargs)
    with pytest.raises(LeaseError):
        table.grant(**params)
    assert table.held() == 0
    assert table.granted == 0


def test_duplicate_req_id_rejected_and_first_lease_kept(table):
    table.grant("r1", [1], readers=1, ttl_s=10.0)
    with pytest.raises(LeaseError, match="already holds"):
        table.grant("r1", [2, 3], readers=1, ttl_s=10.0)
    assert table.get("r1").block_ids == (1,)
    assert table.counters()["held_blocks"] == 1


def test_lease_error_is_typed_value_error():
    assert issubclass(LeaseError, ValueError)
    assert issubclass(LeaseError, KVTransferError)


def test_empty_block_list_allowed(table):
    table.grant("r1", [], readers=1, ttl_s=1.0)
    assert table.notify("r1", "d0") == []
    assert table.released_by_readers == 1


# -- release by readers ---------------------------------------------------------------

def test_last_reader_releases_blocks(table):
    table.grant("r1", [7, 8], readers=3, ttl_s=10.0)
    assert table.notify("r1", "d0") is None
    assert table.notify("r1", "d1") is None
    assert table.get("r1").readers_heard == frozenset({"d0", "d1"})
    assert table.get("r1").readers_remaining == 1
    assert table.notify("r1", "d2") == [7, 8]
    assert table.get("r1") is None
    assert table.held() == 0
    assert table.counters()["held_blocks"] == 0
    assert table.released_by_readers == 1


def test_notify_idempotent_per_reader(table):
    table.grant("r1", [1], readers=2, ttl_s=10.0)
    assert table.notify("r1", "d0") is None
    assert table.notify("r1", "d0") is None  # redelivery does not count twice
    assert table.get("r1").readers_remaining == 1
    assert table.notify("r1", "d1") == [1]


def test_notify_unknown_counts_and_never_raises(table):
    assert table.notify("ghost", "d0") is None
    table.grant("r1", [1], readers=1, ttl_s=10.0)
    assert table.notify("r1", "d0") == [1]
    assert table.notify("r1", "d0") is None  # late duplicate after release
    assert table.unknown_notifications == 2
    assert table.released_by_readers == 1


def test_notify_rejects_bad_reader_name(table):
    table.grant("r1", [1], readers=1, ttl_s=10.0)
    with pytest.raises(LeaseError):
        table.notify("r1", "")
    assert table.get("r1").readers_heard == frozenset()


def test_notify_past_deadline_before_sweep_still_releases(table, clock):
    table.grant("r1", [1, 2], readers=1, ttl_s=5.0)
    clock.advance(6.0)
    assert table.notify("r1", "d0") == [1, 2]
    assert table.expire() == []  # already freed: not returned twice
    assert (table.released_by_readers, table.expired) == (1, 0)


# -- expiry -------------------------------------------------------------------------

def test_expire_releases_only_expired_leases_earliest_first(table, clock):
    table.grant("late", [1], readers=1, ttl_s=20.0)
    table.grant("early", [2, 3], readers=2, ttl_s=5.0)
    table.grant("mid", [4], readers=1, ttl_s=10.0)
    table.notify("early", "d0")  # partial readers do not keep it alive
    clock.advance(4.999)
    assert table.expire() == []
    clock.advance(5.001)  # t = +10: "early" and "mid" are due (deadline inclusive)
    assert table.expire() == [("early", [2, 3]), ("mid", [4])]
    assert table.held() == 1
    assert table.expired == 2
    assert table.notify("early", "d1") is None  # late reader: unknown, counted
    assert table.unknown_notifications == 1
    assert table.expire() == []


def test_expire_skips_leases_released_otherwise(table, clock):
    table.grant("a", [1], readers=1, ttl_s=1.0)
    table.grant("b", [2], readers=1, ttl_s=1.0)
    table.notify("a", "d0")
    table.release("b")
    clock.advance(2.0)
    assert table.expire() == []
    assert table.expired == 0


def test_regrant_after_release_uses_new_deadline(table, clock):
    table.grant("r1", [1], readers=1, ttl_s=1.0)
    table.release("r1")
    table.grant("r1", [2], readers=1, ttl_s=10.0)
    clock.advance(2.0)
    assert table.expire() == []  # the old deadline belongs to the old lease
    assert table.get("r1").block_ids == (2,)
    clock.advance(8.0)
    assert table.expire() == [("r1", [2])]


def test_many_early_releases_do_not_leak_heap_entries(table):
    for i in range(1000):
        table.grant(f"r{i}", [i], readers=1, ttl_s=3600.0)
        table.notify(f"r{i}", "d0")
    assert table.held() == 0
    assert len(table._deadlines) <= 64 + 1  # compacted, not 1000 stale entries


# -- abort ----------------------------------------------------------------------------

def test_release_aborts_and_returns_blocks(table):
    table.grant("r1", [3, 4], readers=2, ttl_s=10.0)
    table.notify("r1", "d0")
    assert table.release("r1") == [3, 4]
    assert table.aborted == 1
    assert table.release("r1") == []
    assert table.release("never") == []
    assert table.aborted == 1
    assert table.notify("r1", "d1") is None
    assert table.unknown_notifications == 1


def test_counters_dict(table, clock):
    table.grant("a", [1, 2], readers=1, ttl_s=1.0)
    table.grant("b", [3], readers=1, ttl_s=1.0)
    table.grant("c", [4], readers=1, ttl_s=100.0)
    table.grant("d", [5, 6, 7], readers=2, ttl_s=100.0)
    table.notify("a", "d0")
    table.release("c")
    table.notify("zzz", "d0")
    clock.advance(1.0)
    table.expire()
    assert table.counters() == {
        "held": 1, "held_blocks": 3, "granted": 4, "released_by_readers": 1,
        "expired": 1, "aborted": 1, "unknown_notifications": 1,
    }


# -- property: every block is returned exactly once -----------------------------------

@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 4),
    st.lists(st.tuples(st.sampled_from(["notify", "release", "expire", "tick"]),
                       st.integers(0, 5)), max_size=60),
)
def test_blocks_returned_exactly_once_on_any_path(readers, ops):
    clock = FakeClock()
    table = LeaseTable(clock=clock)
    n_leases = 4
    for i in range(n_leases):
        table.grant(f"r{i}", [10 * i, 10 * i + 1], readers=readers, ttl_s=3.0 + i)
    freed: list[int] = []
    for op, arg in ops:
        req_id = f"r{arg % n_leases}"
        if op == "notify":
            blocks = table.notify(req_id, f"d{arg % readers}")
            if blocks is not None:
                freed.extend(blocks)
        elif op == "release":
            freed.extend(table.release(req_id))
        elif op == "expire":
            for _, blocks in table.expire():
                freed.extend(blocks)
        else:
            clock.advance(arg)
    # Drain whatever is left.
    for i in range(n_leases):
        freed.extend(table.release(f"r{i}"))
    assert sorted(freed) == sorted(b for i in range(n_leases) for b in (10 * i, 10 * i + 1))
    assert table.held() == 0 and table.counters()["held_blocks"] == 0
    assert table.released_by_readers + table.expired + table.aborted == n_leases


def test_readers_can_announce_their_count():
    table = LeaseTable(clock=lambda: 0.0)
    table.grant("r", [1, 2], readers=1, ttl_s=10)
    assert table.notify("r", "d0", readers_expected=2) is None
    assert table.get("r").readers_expected == 2
    assert table.notify("r", "d1", readers_expected=2) == [1, 2]
    table.grant("s", [3], readers=1, ttl_s=10)
    with pytest.raises(LeaseError):
        table.notify("s", "d0", readers_expected=0)
    assert table.get("s").readers_heard == frozenset()
