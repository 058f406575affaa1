"""The engine's load meter: queues (now and time-weighted), latencies, idle (fake clock)."""

from __future__ import annotations

import dataclasses

import pytest

from actors.protocol import BackendStats
from actors.engine.load import EngineLoad, LoadMeter
from actors.protocol import EngineRequest, SamplingSpec, TokenChunk


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def req(n_prompt=100, max_tokens=10):
    return EngineRequest("r", SamplingSpec(max_tokens=max_tokens), prompt_token_ids=tuple(range(n_prompt)))


def test_prefill_queue_counts_prompt_tokens_in_flight_and_records_latency():
    clock = Clock()
    meter = LoadMeter(window_s=10.0, clock=clock)
    a, b = meter.prefill_started(req(300)), meter.prefill_started(req(200))
    assert meter.snapshot().queued_prompt_tokens == 500
    clock.t += 2.0
    meter.prefill_done(a)
    meter.prefill_done(b)
    snap = meter.snapshot()
    assert (snap.queued_prompt_tokens, snap.prefill_latency_p90_s) == (0, 2.0)


def test_the_time_weighted_queue_remembers_load_between_samples_and_fades():
    clock = Clock()
    meter = LoadMeter(window_s=10.0, clock=clock)
    started = meter.prefill_started(req(1000))
    clock.t += 10.0
    meter.prefill_done(started)
    after = meter.snapshot().queued_prompt_tokens_avg
    assert after == pytest.approx(1000 * (1 - 2.718281828 ** -1), rel=1e-3)
    clock.t += 30.0
    assert meter.snapshot().queued_prompt_tokens_avg < 0.05 * after


def test_decode_debt_is_paid_by_tokens_and_settled_on_exit_with_itl_from_gaps_after_the_first():
    clock = Clock()
    meter = LoadMeter(clock=clock)
    track = meter.decode_started(req(max_tokens=10))
    assert meter.snapshot().outstanding_tokens == 10
    clock.t += 1.0  # the first chunk waits for the KV: not an inter-token gap
    track.observe(TokenChunk("r", (1,)))
    clock.t += 0.2
    track.observe(TokenChunk("r", (2, 3)))
    snap = meter.snapshot()
    assert (snap.outstanding_tokens, snap.itl_p90_s) == (7, pytest.approx(0.1))
    track.done()
    assert meter.snapshot().outstanding_tokens == 0


def test_an_engine_is_idle_only_without_streams_prefills_or_leases():
    meter = LoadMeter(clock=Clock())
    stats = BackendStats("vllm", num_blocks=100, free_blocks=75, held_leases=0)
    load = EngineLoad.of("p0", "prefill", 0, stats, meter.snapshot())
    assert (load.idle, load.kv_usage) == (True, 0.25)
    held = dataclasses.replace(stats, held_leases=1)
    assert not EngineLoad.of("p0", "prefill", 0, held, meter.snapshot()).idle
    meter.prefill_started(req())
    assert not EngineLoad.of("p0", "prefill", 0, stats, meter.snapshot()).idle
