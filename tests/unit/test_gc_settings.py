"""The ingress's collector settings (serving/front/heap.py): serving thresholds by default, CPython's on request,
a typed refusal of anything else."""

import gc

import pytest

from serving.front.heap import SERVING_THRESHOLD, THRESHOLD_ENV, GcThresholdError, gc_threshold, settle_heap


@pytest.fixture
def restored_gc():
    before = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*before)


def test_the_default_lets_full_passes_come_ten_times_more_rarely():
    assert gc_threshold({}) == SERVING_THRESHOLD == (700, 10, 100)


def test_the_environment_restores_cpythons_defaults():
    assert gc_threshold({THRESHOLD_ENV: "700,10,10"}) == (700, 10, 10)


@pytest.mark.parametrize("raw", ["700,10", "a,b,c", "700,-1,10", ""])
def test_a_malformed_threshold_is_refused_naming_the_variable(raw):
    with pytest.raises(GcThresholdError, match=THRESHOLD_ENV):
        gc_threshold({THRESHOLD_ENV: raw})


def test_settling_the_heap_freezes_what_exists_and_sets_the_thresholds(restored_gc):
    assert settle_heap({}) == SERVING_THRESHOLD
    assert gc.get_threshold() == SERVING_THRESHOLD
    assert gc.get_freeze_count() > 0
