"""The control plane at cluster size (issue 21): one real Coordinator actor, real routers, simulated engines.

    flock /tmp/raypd-cpu.lock .venv/bin/python benchmarks/control_plane.py \
        --out benchmarks/results/control_plane.json
    # options: --engines 16,64,256 --handoff-rate 20000 --kv-rate 800 --measure-s 4 --requests 2000
    #          --short-share 0.25 --streams-per-decode 8 --faulty-decodes 2 --breaker-cooldown-s 1

Per engine count (half prefill, half decode engines, one rank each), on one local Ray cluster:

  1. the Coordinator actor is started as deployments start it (`start_coordinator`); one
     `SimFleet` actor (`cpbench.fleet`) registers every engine with a valid handshake payload
     and keeps it registered (`watch_registration`), as `EngineActor` does;
  2. ledger: the fleet offers `--handoff-rate` handoffs/s through one real `LedgerReporter` per
     decode engine (open + `--units` per-rank outcomes -> verdict -> breaker update at the
     coordinator); measured over `--measure-s` after a warm-up: verdicts the coordinator
     completed (its own counters) and the CPU time of its process (psutil: every thread);
  3. KV events: every engine publishes `--kv-rate` events/s the way `KVEventsRelay` sends them
     (one call in flight, at most one per `--kv-interval-ms`); measured the same way;
  4. routing: a real `Router` (EnginePool, planner with the default `slo` placement,
     PrefixCacheView synced from the coordinator, a real RayDirectory) over simulated engine
     clients that answer at once and publish no rates (the router predicts them with the
     priors of `router.slo`); the fleet's engines hold real vLLM block hashes of 32 shared
     384-token system prompts (4 per engine). The router first opens `--streams-per-decode`
     streams per decode engine and keeps them open; then `--requests` requests (long turns of
     512 tokens, `--short-share` short ones of 416: `cpbench.mix`) arrive at `--route-rate`/s,
     first with the router alone, then again while every engine's KV events flow at the goal's
     rate (the coordinator and the fleet then share the host's cores with the router; the CPU
     the router spends keeping its index copy is measured). The first prefill engine's pairs
     with `--faulty-decodes` decode engines fail every prefill, and the coordinator's breakers
     cool down in `--breaker-cooldown-s`, so pairs open, half-open and are probed during the runs.
     Routing time = arrival -> the first engine call; the decision mix (the planner's
     decisions, each request's path, retries, probes awaited and granted, `pick_prefill`
     calls, breakers opened) is reported beside it; coordinator calls awaited by a request's
     own task are counted;
  5. restart: `ray.kill(coordinator, no_restart=False)`; the warm router's first route, a cold
     router's first successful route, and when the warm router's view is the new incarnation's
     with every engine registered again;
  6. the prefix index's memory per engine (tracemalloc on the real class, `cpbench.memory`).

Results (JSON + .txt with the command, git commit, host and load average) go to `--out`;
the script prints the table and the goals, met or missed, as measured.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import gc
import json
import os
import pickle
import platform
import shlex
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Ray's workers (the fleet actor, the coordinator) import `cpbench` and the project as this process does
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])

import psutil  # noqa: E402
import ray  # noqa: E402

from actors.control.coordinator_actor import NAMESPACE, start_coordinator  # noqa: E402
from actors.control.breaker_config import BreakerConfig  # noqa: E402
from actors.engine.ledger_reporter import DEFAULT_MAX_DELAY_S  # noqa: E402
from serving.bench.provenance import git_state  # noqa: E402
from cpbench import report  # noqa: E402
from cpbench.fleet import BLOCK_SIZE, NEW_BLOCKS, RESIDENT, SimFleet  # noqa: E402
from cpbench.memory import index_memory  # noqa: E402
from cpbench.mix import LONG_OWN_TOKENS, SHORT_OWN_TOKENS, FaultyPairs, faulty_decodes  # noqa: E402
from cpbench.routing import (  # noqa: E402
    Marks,
    after_restart,
    breaker_change,
    build_router,
    hold_streams,
    measure,
    repair_pairs,
)
from serving.config import RouterConfig  # noqa: E402
from serving.front.heap import settle_heap  # noqa: E402

NAME = "raypd-cpbench-coordinator"
SYSTEM_PROMPTS, SYSTEM_LEN, PER_ENGINE = 32, 384, 4
BREAKER_THRESHOLD = 3  # consecutive failures that open a pair (the product's default)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engines", default="16,64,256")
    p.add_argument("--handoff-rate", type=float, default=20_000.0, help="handoffs/s offered (all decode engines)")
    p.add_argument("--units", type=int, default=2, help="per-rank outcome units per handoff")
    p.add_argument("--ledger-delay-ms", type=float, default=DEFAULT_MAX_DELAY_S * 1e3)
    p.add_argument("--kv-rate", type=float, default=800.0, help="KV events/s offered per engine")
    p.add_argument("--kv-interval-ms", type=float, default=100.0, help="at most one kv_events call per engine per")
    p.add_argument("--warmup-s", type=float, default=1.5)
    p.add_argument("--measure-s", type=float, default=4.0)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--route-rate", type=float, default=500.0)
    p.add_argument("--short-share", type=float, default=0.25, help="share of short turns among routed requests")
    p.add_argument("--streams-per-decode", type=int, default=8, help="streams held open per decode engine")
    p.add_argument("--faulty-decodes", type=int, default=2,
                   help="decode engines whose pair with the first prefill engine fails every prefill")
    p.add_argument("--breaker-cooldown-s", type=float, default=1.0, help="the coordinator's breaker cooldown")
    p.add_argument("--probe-window-s", type=float, default=1.0, help="the coordinator's breaker probe window")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def cpu_s(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def windowed(coordinator, proc: psutil.Process, warmup_s: float, measure_s: float):
    """(stats before, stats after, coordinator CPU seconds, wall seconds) over the measured window."""
    time.sleep(warmup_s)
    s0, c0, t0 = ray.get(coordinator.control_stats.remote()), cpu_s(proc), time.monotonic()
    time.sleep(measure_s)
    s1, c1, t1 = ray.get(coordinator.control_stats.remote()), cpu_s(proc), time.monotonic()
    return s0, s1, c1 - c0, t1 - t0


def run_size(n: int, args: argparse.Namespace) -> dict:
    breaker = {"failure_threshold": BREAKER_THRESHOLD, "cooldown_s": args.breaker_cooldown_s,
               "probe_window_s": args.probe_window_s}
    coordinator = start_coordinator(name=NAME, max_restarts=5, hang_check_s=3600.0, breaker=breaker)
    ray.get(coordinator.ping.remote(), timeout=60)
    engines = [(f"p{i}", "prefill") for i in range(n // 2)] + [(f"d{i}", "decode") for i in range(n - n // 2)]
    fleet = ray.remote(SimFleet).options(num_cpus=0, max_concurrency=100_000).remote(NAME, NAMESPACE, engines)
    out: dict = {"engines": n, "prefills": n // 2, "decodes": n - n // 2}
    try:
        out["register_s"] = ray.get(fleet.register_all.remote(), timeout=600)
        proc = psutil.Process(ray.get(coordinator.pid.remote()))
        out["pairs"] = ray.get(coordinator.control_stats.remote()).pairs
        t0 = time.perf_counter()
        table = ray.get(coordinator.routes.remote())
        out["route_build_ms"] = (time.perf_counter() - t0) * 1e3  # one build + the call (the first after registration)
        out["route_table_kb"] = len(pickle.dumps(table)) / 1024

        span = args.warmup_s + args.measure_s + 0.5
        ref = fleet.run_handoffs.remote(args.handoff_rate, span, args.units, args.ledger_delay_ms / 1e3)
        s0, s1, cpu, wall = windowed(coordinator, proc, args.warmup_s, args.measure_s)
        load = ray.get(ref, timeout=600)
        verdicts = sum(s1.verdicts.values()) - sum(s0.verdicts.values())
        batches = s1.ledger_batches - s0.ledger_batches
        out["handoffs"] = {"verdicts": verdicts, "window_s": wall, "cpu_s": cpu, "per_s": verdicts / wall,
                           "cpu_util": cpu / wall, "per_core_s": verdicts / cpu if cpu else 0.0, "batches": batches,
                           "records_per_batch": (s1.ledger_records - s0.ledger_records) / max(1, batches),
                           "offered": load.offered, "lost_records": load.lost_records, "dropped": load.dropped,
                           "in_flight_after": ray.get(coordinator.control_stats.remote()).handoffs_in_flight}

        ref = fleet.run_kv.remote(args.kv_rate, span, args.kv_interval_ms / 1e3)
        s0, s1, cpu, wall = windowed(coordinator, proc, args.warmup_s, args.measure_s)
        kv = ray.get(ref, timeout=600)
        events, blocks, calls = s1.kv_events - s0.kv_events, s1.kv_blocks - s0.kv_blocks, s1.kv_calls - s0.kv_calls
        out["kv"] = {"events": events, "blocks": blocks, "calls": calls, "window_s": wall, "cpu_s": cpu,
                     "events_per_s": events / wall, "blocks_per_s": blocks / wall, "cpu_util": cpu / wall,
                     "events_per_core_s": events / cpu if cpu else 0.0, "blocks_per_core_s": blocks / cpu if cpu else 0.0,
                     "events_per_call": events / max(1, calls), "failures": kv.failures, "index_blocks": s1.index_blocks}

        out.update(asyncio.run(routing_and_restart(coordinator, fleet, engines, args)))
        out["index_memory"] = index_memory(n)
        out["coordinator_rss_mb"] = psutil.Process(ray.get(coordinator.pid.remote())).memory_info().rss / 2**20
    finally:
        try:
            ray.get(fleet.stop.remote(), timeout=30)
        except ray.exceptions.RayError:
            pass
        ray.kill(fleet)
        ray.kill(coordinator)
        time.sleep(1.0)
    return out


async def routing_and_restart(coordinator, fleet, engines: list[tuple[str, str]], args: argparse.Namespace) -> dict:
    import random

    rng = random.Random(3)
    prompts = [tuple(rng.randrange(49152) for _ in range(SYSTEM_LEN)) for _ in range(SYSTEM_PROMPTS)]
    held = {e: [prompts[(i * PER_ENGINE + k) % SYSTEM_PROMPTS] for k in range(PER_ENGINE)]
            for i, (e, _) in enumerate(engines)}
    await fleet.publish_prompts.remote(held)
    prefills = [e for e, r in engines if r == "prefill"]
    decodes = [e for e, r in engines if r == "decode"]
    config = RouterConfig(migration_wait_s=0.0)
    marks = Marks()
    faults = FaultyPairs(faulty_decodes(decodes, args.faulty_decodes), prefills[0])
    router, directory = build_router(coordinator, NAME, prefills, decodes, marks, config, faults)
    await router.routes()  # the router's start: its first view (not a request)
    await router.planner.view.refresh()
    pauses: list[float] = []
    full_pauses: list[float] = []  # generation 2: the whole heap since gc.freeze()
    young_pauses: list[float] = []  # generations 0 and 1
    started: list[float] = []

    def gc_watch(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append((time.perf_counter() - started.pop()) * 1e3)
            (full_pauses if info.get("generation") == 2 else young_pauses).append(pauses[-1])

    threshold = settle_heap()  # as the front's lifespan does at start-up (serving/front/heap.py)
    # the decode engines' streams, opened through the router before the measured requests (not measured)
    streams = await hold_streams(router, prompts, args.streams_per_decode * len(decodes))
    builds0 = (await coordinator.control_stats.remote()).route_builds
    gc.callbacks.append(gc_watch)
    try:
        # the router alone (this benchmark's other processes idle), then with every engine's KV events
        # flowing at the goal's rate: the coordinator and the fleet then share this host's 2 cores with it
        run = dict(n=args.requests, rate=args.route_rate, short_share=args.short_share, faults=faults)
        quiet = await measure(router, directory, marks, prompts, tag="a", seed=1, **run)
        upkeep0 = router.planner.view.upkeep_s  # the router's time keeping its index copy current
        goal_rate = report.GOAL_KV_EVENTS / 256  # events/s per engine while routing: the goal's rate
        span = args.requests / args.route_rate + 1.0
        kv = fleet.run_kv.remote(goal_rate, span, args.kv_interval_ms / 1e3)
        t0 = time.perf_counter()
        busy = await measure(router, directory, marks, prompts, tag="b", seed=2, **run)
        kv_during = await kv  # what the fleet delivered: the rate is part of the result, not assumed
        upkeep = (router.planner.view.upkeep_s - upkeep0) / (time.perf_counter() - t0)
    finally:
        gc.callbacks.remove(gc_watch)
    stats = await coordinator.control_stats.remote()

    def summary(res) -> dict:
        ms = res.routing_ms
        return {"requests": res.requests, "rate": args.route_rate, "p50_ms": report.pct(ms, 50),
                "p90_ms": report.pct(ms, 90), "p99_ms": report.pct(ms, 99), "max_ms": max(ms),
                "awaited": res.awaited, "errors": res.errors, "mix": dataclasses.asdict(res.mix)}

    routing = {**summary(quiet), "with_kv_load": summary(busy), "index_upkeep_core": upkeep,
               "decisions": busy.decisions, "view_waits": router.view.waits, "gc_pauses": len(pauses),
               "gc_max_ms": max(pauses, default=0.0), "gc_full": len(full_pauses), "gc_threshold": list(threshold),
               "gc_young_max_ms": max(young_pauses, default=0.0), "gc_tracked": len(gc.get_objects()),
               "gc_full_ms": sum(full_pauses), "route_builds": stats.route_builds - builds0,
               "route_unchanged": stats.route_unchanged, "kv_events_per_s": kv_during.events / span, "streams_held": len(streams),
               "faulty_pairs": sorted(f"{p}->{d}" for d, p in faults.pairs)}
    for s in streams:
        s.close()
    await router.drain()
    await repair_pairs(coordinator, router, faults)
    # a pair that is not faulty (closed until now): its breaker opens by the decode engine's reports
    change = await breaker_change(coordinator, router, directory, decodes[-1], prefills[-1], BREAKER_THRESHOLD)
    restart = await after_restart(coordinator, NAME, router, directory, marks, prefills, decodes, prompts, config)
    return {"routing": routing, "breaker_change": change, "restart": restart}


def routing_assumptions(args: argparse.Namespace) -> str:
    """What the routing phase's decision mix rests on (the results file states it beside the times)."""
    slo = RouterConfig().slo
    return (f"default router config (placement slo, no_prefill_fallback decode_local); the simulated engines answer "
            f"at once and publish no rates, so the SLO model predicts them with router.slo's priors "
            f"({slo.prior_prefill_tokens_per_s:.0f} prompt tokens/s, a {slo.prior_step_s * 1e3:.0f} ms step + "
            f"{slo.prior_step_per_stream_s * 1e3:.0f} ms per stream; ITL target {slo.itl_target_s * 1e3:.0f} ms); "
            f"the router first opens {args.streams_per_decode} streams per decode engine and keeps them open, so a "
            f"long turn ({SYSTEM_LEN} + {LONG_OWN_TOKENS} tokens) prefilled on its decode engine would stall them "
            f"past the ITL target and the model sends it to a prefill engine; short turns ({SYSTEM_LEN} + "
            f"{SHORT_OWN_TOKENS}, {args.short_share:.0%} of the requests) it may keep colocated. Faults: the first "
            f"prefill engine's pairs with {args.faulty_decodes} decode engines fail every prefill (retried on another "
            f"prefill engine, reported to the ledger); breakers open after {BREAKER_THRESHOLD} failures and cool down "
            f"in {args.breaker_cooldown_s:g} s (the product's default: {BreakerConfig().cooldown_s:g} s), probe "
            f"window {args.probe_window_s:g} s, so pairs open, half-open and are probed within a run")


def main(argv: list[str]) -> int:
    args = parse(argv)
    started = time.monotonic()
    res: dict = {
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "git": git_state(ROOT),
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg": [round(x, 2) for x in os.getloadavg()]},
        "assumptions": {
            "workload": (f"SmolLM2-135M cache shape (30 layers, 3 KV heads, head 64, fp32), block size {BLOCK_SIZE}; "
                         f"routed prompts = one of {SYSTEM_PROMPTS} shared {SYSTEM_LEN}-token system prompts + "
                         f"{LONG_OWN_TOKENS} tokens of their own (long turns) or {SHORT_OWN_TOKENS} (short turns); "
                         f"{args.units} per-rank outcome units per handoff"),
            "kv_derivation": (f"vLLM's block pool emits one BlockStored per request step with the blocks that became "
                              f"full and one BlockRemoved per evicted block; a 512-token prompt at block size "
                              f"{BLOCK_SIZE} whose {SYSTEM_LEN}-token prefix is cached stores {NEW_BLOCKS} new blocks "
                              f"(32 on a miss) and, with the cache full, evicts as many: {1 + NEW_BLOCKS} events / "
                              f"{2 * NEW_BLOCKS} block changes per request ({RESIDENT} requests resident per engine). "
                              f"Measured SmolLM2 fp32 on one CPU core here (benchmarks/results/pd_vs_colocated.txt: "
                              f"512-token TTFT p50 1218 ms) is ~0.8 prefills/s = ~7 events/s per engine; the goal "
                              f"(100k events/s at 256 engines) is {report.GOAL_KV_EVENTS / 256:.0f} events/s = "
                              f"{report.GOAL_KV_EVENTS / 256 / (1 + NEW_BLOCKS):.0f} requests/s per engine, a GPU-class rate"),
            "offered": (f"{args.handoff_rate:,.0f} handoffs/s (ledger reporter window {args.ledger_delay_ms:.0f} ms); "
                        f"{args.kv_rate:,.0f} KV events/s per engine (one kv_events call per engine per "
                        f"{args.kv_interval_ms:.0f} ms at most); {args.requests} routed requests at {args.route_rate:.0f}/s, "
                        f"router alone, then again with KV events at the goal rate meanwhile"),
            "routing": routing_assumptions(args),
        },
        "args": vars(args),
        "sizes": [],
    }
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir="/tmp/raypd-ray", namespace=NAMESPACE,
             log_to_driver=False)
    try:
        for n in [int(x) for x in args.engines.split(",")]:
            print(f"--- {n} engines", flush=True)
            res["sizes"].append(run_size(n, args))
            print(json.dumps(res["sizes"][-1], default=str)[:2000], flush=True)
    finally:
        ray.shutdown()
    res["host"]["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    res["wall_s"] = time.monotonic() - started
    text = report.header(res) + report.table(res)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2, default=str))
        Path(args.out).with_suffix(".txt").write_text(text + "\n")
        print(f"results written to {args.out} (+ .txt)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
