"""The engine's load meter: queues (now and time-weighted), latencies, idle (fake clock)."""

from __future__ import annotations

import dataclasses

import pytest

from actors.protocol.stats import BackendStats
from actors.engine.load import EngineLoad, LoadMeter
from actors.protocol.request import EngineRequest, SamplingSpec, TokenChunk


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


def test_the_meter_teaches_the_engines_rate_model_with_its_own_queue_and_batch():
    """Prefills teach the prefill rate (the tokens queued ahead count as work); gaps teach the step at
    the engine's batch, except while a prompt prefills there (its chunks ride in those steps)."""
    clock = Clock()
    meter = LoadMeter(clock=clock)
    meter.budget_tokens = 512
    streams = [meter.decode_started(req(max_tokens=1000)) for _ in range(4)]  # pulled KV: no local prefill
    for s in streams:
        s.observe(TokenChunk("r", (1,)))  # first chunks: not gaps
    before = meter.rates()
    assert (before.samples, before.decode_streams, before.chunk_budget_tokens) == (0.0, 4, 512)
    for _ in range(60):  # 4 streams: a 28 ms step (20 ms + 2 ms per stream)
        clock.t += 0.028
        for s in streams:
            s.observe(TokenChunk("r", (2,)))
    a = meter.prefill_started(req(1000))
    b = meter.prefill_started(req(1000))  # 1000 tokens queued ahead of it
    assert meter.rates().queued_prompt_tokens == 2000 and meter.rates().prompt_tokens_per_s > 0
    clock.t += 0.5
    for s in streams:  # a gap while prompts prefill: not a bare step
        s.observe(TokenChunk("r", (3,)))
    meter.prefill_done(a, cached_tokens=0)
    clock.t += 0.5
    meter.prefill_done(b, cached_tokens=0)
    r = meter.rates()
    # 60 steps seen through 4 streams each (1/4 a gap) and 2 prefills, decayed a little meanwhile
    assert r.samples == pytest.approx(62, rel=0.05) and r.prefill_samples == pytest.approx(2, rel=0.05)
    assert r.decode_step_s(4) == pytest.approx(0.028, rel=0.1)
    snap = meter.snapshot()
    assert snap.rates == r and snap.prefill_tokens_per_s == pytest.approx(r.prefill_tokens_per_s)


def test_a_local_prefill_is_queued_until_its_first_chunk_and_teaches_the_prefill_rate():
    clock = Clock()
    meter = LoadMeter(clock=clock)
    track = meter.decode_started(req(n_prompt=800, max_tokens=4), local_prefill=True)
    assert meter.snapshot().queued_prompt_tokens == 800
    clock.t += 1.0
    track.observe(TokenChunk("r", (1,), num_cached_tokens=0))
    r = meter.rates()
    assert (r.queued_prompt_tokens, r.prefill_samples) == (0, pytest.approx(1.0))
    failed = meter.decode_started(req(n_prompt=300, max_tokens=4), local_prefill=True)
    failed.done()  # ended before its first token: out of the queue, nothing learned
    assert (meter.rates().queued_prompt_tokens, meter.rates().prefill_samples) == (0, pytest.approx(1.0))
