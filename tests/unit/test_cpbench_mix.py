"""The control-plane benchmark's decision mix without Ray: the workload's turns and faulty pairs, the
per-run tally, the report's mix columns and goals, and one routing run of the real Router against an
in-process Coordinator (the mix is disaggregated, faulty pairs open their breakers, a half-open pair's
probe is awaited and counted for the request that waited for it, repaired pairs close)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # the benchmark imports its package as `cpbench`

from cpbench import report  # noqa: E402
from cpbench.mix import (  # noqa: E402
    ERROR,
    LOCAL,
    PD,
    PD_PROBED,
    PD_RETRIED,
    BreakerCount,
    FaultyPairs,
    RoutedPath,
    counter_delta,
    faulty_decodes,
    is_short_turn,
    tally,
)


def test_short_turns_are_the_share_spread_evenly():
    short = [is_short_turn(i, 0.25) for i in range(400)]
    assert sum(short) == 100
    assert all(sum(short[k:k + 4]) == 1 for k in range(0, 400, 4))
    assert not any(is_short_turn(i, 0.0) for i in range(50))
    assert all(is_short_turn(i, 1.0) for i in range(50))


def test_faulty_decodes_are_spread_and_bounded():
    decodes = [f"d{i}" for i in range(8)]
    assert faulty_decodes(decodes, 2) == ["d0", "d4"]
    assert faulty_decodes(decodes, 0) == []
    assert faulty_decodes(decodes, 20) == decodes


def test_only_the_faulty_pairs_fail_and_failures_are_counted():
    faults = FaultyPairs(["d0", "d4"], "p0")
    assert faults.fails("d0", "p0") and faults.fails("d4", "p0")
    assert not faults.fails("d1", "p0") and not faults.fails("d0", "p1") and not faults.fails(None, "p0")
    assert faults.failed == 2


def test_tally_counts_paths_probes_retries_and_times_per_path():
    routed = [RoutedPath(PD, 0, 1, 1.0), RoutedPath(PD, 1, 1, 3.0), RoutedPath(PD, 1, 2, 5.0),
              RoutedPath(LOCAL, 0, 0, 0.5), RoutedPath(ERROR, 0, 0, None)]
    before = BreakerCount.of([("closed", 0), ("open", 1)])
    after = BreakerCount.of([("half_open", 2), ("open", 2)])
    mix = tally(routed, {"remote/itl_protect": 3, "local/ttft": 1, "remote/ttft": 0}, 4, 1, 2, before, after)
    assert mix.paths == {PD: 3, LOCAL: 1, ERROR: 1}
    assert mix.disaggregated_share == 0.75  # of the 4 routed, not of the refused one
    assert (mix.retried, mix.probe_asks, mix.probed_requests, mix.probes_granted) == (1, 2, 2, 1)
    assert mix.decisions == {"remote/itl_protect": 3, "local/ttft": 1}
    assert mix.breaker_opens == 3 and mix.breakers_after == {"half_open": 1, "open": 1}
    assert mix.times[PD].requests == 3 and mix.times[PD].max_ms == 5.0
    assert mix.times[PD_PROBED].requests == 2 and mix.times[PD_PROBED].p50_ms == 3.0
    assert mix.times[PD_RETRIED].requests == 1 and mix.times[LOCAL].p99_ms == 0.5
    assert counter_delta({"a": 3, "b": 1}, {"a": 1, "b": 1}) == {"a": 2}


def _results(share: float) -> dict:
    """The committed results file with a mix of `share` disaggregated put into every routing run."""
    res = json.loads((ROOT / "benchmarks" / "results" / "control_plane.json").read_text())
    pd = round(100 * share)
    routed = [RoutedPath(PD, 1 if i == 0 else 0, 2 if i == 1 else 1, 1.0) for i in range(pd)]
    routed += [RoutedPath(LOCAL, 0, 0, 0.5) for _ in range(100 - pd)]
    mix = dataclasses.asdict(tally(routed, {"remote/itl_protect": pd}, pd + 1, 1, 1,
                                   BreakerCount(0, {}), BreakerCount(2, {"open": 1, "closed": 63}),
                                   probes_asked=2, probes_carried=1))
    for size in res["sizes"]:
        size["routing"]["mix"] = mix
        size["routing"]["with_kv_load"]["mix"] = mix
    return res


def _goal(res: dict, start: str) -> tuple[str, bool]:
    return next((measured, met) for goal, measured, met in report.goals(res) if goal.startswith(start))


def test_the_report_shows_the_mix_beside_the_times_and_judges_the_goal_on_it():
    res = _results(0.8)
    text = report.table(res)
    assert "P/D" in text and "80.0%" in text and "pd, probe awaited 1" in text
    measured, met = _goal(res, "routing p99")
    assert "80.0% of the decisions disaggregated" in measured
    assert met == (res["sizes"][-1]["routing"]["with_kv_load"]["p99_ms"] < report.GOAL_P99_MS)
    assert _goal(res, "the decision mix")[1] is True
    local = _results(0.3)  # a mostly colocated run is not the disaggregated mix: neither goal is met
    assert not _goal(local, "routing p99")[1] and not _goal(local, "the decision mix")[1]


def test_results_from_before_the_mix_still_render_and_the_routing_goal_is_not_judged():
    res = json.loads((ROOT / "benchmarks" / "results" / "control_plane.json").read_text())
    for size in res["sizes"]:
        for run in (size["routing"], size["routing"]["with_kv_load"]):
            run.pop("mix", None)
    text = report.table(res)
    assert "not the disaggregated mix: not judged" in text
    assert not any(goal.startswith("the decision mix") for goal, _, _ in report.goals(res))


# ------------------------------------------------------------- one routing run, in process
class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        async def call():
            await asyncio.sleep(0)  # an actor call never completes within the caller's step
            return await self.fn(*args)
        return asyncio.ensure_future(call())


class _Handle:
    """The Coordinator object behind the calls a router makes of its actor handle."""

    def __init__(self, coordinator):
        self.coordinator = coordinator

    def __getattr__(self, name):
        return _Method(getattr(self.coordinator, name))


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_a_routing_run_is_disaggregated_opens_the_faulty_pairs_and_awaits_their_probes():
    pytest.importorskip("ray")
    from actors.control.coordinator import Coordinator
    from actors.prefix_wire import BlocksStored, KVEventsBatch
    from actors.protocol.registration import EngineInfo
    from cpbench.fleet import COMPAT, SCHEME, handshake
    from cpbench.routing import Marks, build_router, hold_streams, measure, repair_pairs
    from serving.config import RouterConfig

    async def go():
        clock = _Clock()
        coordinator = Coordinator(hang_check_s=3600, breaker={"failure_threshold": 3, "cooldown_s": 5.0,
                                                               "probe_window_s": 5.0})
        coordinator.ledger.clock = clock  # before any breaker exists: they all take it
        engines = [(f"p{i}", "prefill") for i in range(4)] + [(f"d{i}", "decode") for i in range(4)]
        for e, role in engines:
            await coordinator.register_engine(e, role, [handshake(e, role)], None,
                                              EngineInfo("synthetic", COMPAT.model_id, 1))
        rng = random.Random(3)
        prompts = [tuple(rng.randrange(49152) for _ in range(384)) for _ in range(8)]
        for i, (e, _) in enumerate(engines):  # every engine holds 2 of the 8 system prompts
            held = [prompts[(2 * i + k) % 8] for k in range(2)]
            await coordinator.kv_events(e, KVEventsBatch(SCHEME, tuple(BlocksStored(tuple(SCHEME.block_hashes(p)))
                                                                       for p in held)))
        prefills, decodes = [e for e, r in engines if r == "prefill"], [e for e, r in engines if r == "decode"]
        faults = FaultyPairs(["d0", "d2"], "p0")
        router, directory = build_router(_Handle(coordinator), None, prefills, decodes, Marks(),
                                         RouterConfig(migration_wait_s=0.0), faults)
        await router.routes()
        await router.planner.view.refresh()
        streams = await hold_streams(router, prompts, 4 * len(decodes))
        marks = router.pool.prefills["p0"].marks
        first = await measure(router, directory, marks, prompts, 200, 2000.0, seed=1, tag="a", short_share=0.25,
                              faults=faults)
        clock.now += 6.0  # past the cooldown: the faulty pairs are half-open
        await router.routes(force=True)
        second = await measure(router, directory, marks, prompts, 200, 2000.0, seed=2, tag="b", short_share=0.25,
                               faults=faults)
        for s in streams:
            s.close()
        await router.drain()
        repaired = await repair_pairs(_Handle(coordinator), router, faults)
        states = {(b.decode_id, b.prefill_id): b.state for b in router.view.table.breakers}
        for t in coordinator._timers:
            t.cancel()
        return first.mix, second.mix, second.awaited, repaired, states

    first, second, awaited, repaired, states = asyncio.run(go())
    for mix in (first, second):
        assert mix.disaggregated_share >= 0.5, mix
        assert mix.pick_prefill_calls >= mix.paths[PD]
    assert first.breaker_opens >= 1 and first.retried >= 1 and first.prefills_failed >= 3
    # the half-open pairs are probed: asked in the background, granted, carried by a later request;
    # every request had a closed pair to take, so none waited for a probe
    assert second.probes_asked >= 1 and second.probes_granted >= 1 and second.probes_carried >= 1, second
    assert second.probe_asks == 0 and awaited.get("admit_probe", 0) == 0 and PD_PROBED not in second.times
    # before the restart phase the faulty pairs are repaired: their breakers close, whatever their state
    assert repaired == 2 and states[("d0", "p0")] == states[("d2", "p0")] == "closed"
