"""The control-plane benchmark's goals and text table, computed from its results JSON alone."""

from __future__ import annotations

import math
from typing import Any
from serving.bench.provenance import header_line

GOAL_HANDOFFS = 10_000  # per second, one coordinator core, 256 engines
GOAL_KV_EVENTS = 100_000
GOAL_P99_MS = 2.0


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def goals(res: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(goal, measured, met) for the issue's goals, judged at the largest engine count."""
    sizes = res["sizes"]
    big, small = sizes[-1], sizes[0]
    out = [
        (f">= {GOAL_HANDOFFS:,} handoffs/s on one coordinator core, {big['engines']} engines",
         f"{big['handoffs']['per_core_s']:,.0f} per core-second ({big['handoffs']['per_s']:,.0f}/s wall at "
         f"{big['handoffs']['cpu_util']:.0%} of a core)", big["handoffs"]["per_core_s"] >= GOAL_HANDOFFS),
        (f">= {GOAL_KV_EVENTS:,} KV events/s on one coordinator core, {big['engines']} engines",
         f"{big['kv']['events_per_core_s']:,.0f} events ({big['kv']['blocks_per_core_s']:,.0f} blocks) per "
         f"core-second ({big['kv']['events_per_s']:,.0f}/s wall at {big['kv']['cpu_util']:.0%})",
         big["kv"]["events_per_core_s"] >= GOAL_KV_EVENTS),
        (f"routing p99 < {GOAL_P99_MS} ms at {big['engines']} engines (router alone)",
         f"{big['routing']['p99_ms']:.3f} ms (with KV events at the goal rate on the same 2 cores: "
         f"{big['routing']['with_kv_load']['p99_ms']:.3f} ms)", big["routing"]["p99_ms"] < GOAL_P99_MS),
    ]
    if len(sizes) > 1:
        # judged on the median as well as the tail: a tail on a shared 2-core host moves run to run
        p99 = big["routing"]["p99_ms"] / small["routing"]["p99_ms"]
        p50 = big["routing"]["p50_ms"] / small["routing"]["p50_ms"]
        allowed = math.log(big["engines"]) / math.log(small["engines"])
        out.append((f"routing time grows at most logarithmically ({small['engines']} -> {big['engines']} engines: "
                    f"<= x{allowed:.2f}, p50 and p99)", f"p50 x{p50:.2f}, p99 x{p99:.2f}", max(p50, p99) <= allowed))
    runs = [r for s in sizes for r in (s["routing"], s["routing"]["with_kv_load"])]
    awaited = sum(sum(r["awaited"].values()) for r in runs)
    probes = sum(r["awaited"].get("admit_probe", 0) for r in runs)
    out.append(("no request awaits a coordinator round trip before its first token",
                f"{awaited - probes} awaited calls in {sum(r['requests'] for r in runs)} requests "
                f"(+ {probes} half-open probes); warm router after a coordinator restart: "
                f"{max(s['restart']['warm_first_route_ms'] for s in sizes):.1f} ms to its first route",
                awaited - probes == 0))
    return out


def table(res: dict[str, Any]) -> str:
    a = res["assumptions"]
    lines = [
        f"workload: {a['workload']}",
        f"KV events per engine (derived): {a['kv_derivation']}",
        f"offered: {a['offered']}",
        "",
        f"{'engines':>7} {'reg s':>6} | {'handoffs/s':>10} {'coord CPU':>9} {'per core-s':>10} | {'KV ev/s':>9} "
        f"{'blocks/s':>9} {'coord CPU':>9} {'ev/core-s':>10} | {'route p50':>9} {'p99 ms':>7} {'max':>6} "
        f"{'+KV p99':>7} {'awaited':>7} | {'table KB':>8} {'index B/eng':>11}",
        "-" * 150,
    ]
    for s in res["sizes"]:
        h, k, r, m = s["handoffs"], s["kv"], s["routing"], s["index_memory"]
        lines.append(
            f"{s['engines']:>7} {s['register_s']:>6.2f} | {h['per_s']:>10,.0f} {h['cpu_util']:>9.0%} "
            f"{h['per_core_s']:>10,.0f} | {k['events_per_s']:>9,.0f} {k['blocks_per_s']:>9,.0f} {k['cpu_util']:>9.0%} "
            f"{k['events_per_core_s']:>10,.0f} | {r['p50_ms']:>9.3f} {r['p99_ms']:>7.3f} {r['max_ms']:>6.2f} "
            f"{r['with_kv_load']['p99_ms']:>7.3f} {sum(r['awaited'].values()) + sum(r['with_kv_load']['awaited'].values()):>7} | "
            f"{s['route_table_kb']:>8.0f} {m['owner_bytes_per_engine']:>11,.0f}")
    lines += ["", "per size, in detail:"]
    for s in res["sizes"]:
        h, k, r, x = s["handoffs"], s["kv"], s["routing"], s["restart"]
        lines.append(f"  {s['engines']} engines ({s['prefills']} prefill + {s['decodes']} decode, {s['pairs']} pairs):")
        lines.append(f"    ledger: {h['verdicts']:,} verdicts in {h['window_s']:.1f} s, coordinator CPU {h['cpu_s']:.2f} s; "
                     f"{h['batches']:,} report_batch calls ({h['records_per_batch']:.1f} records each), "
                     f"lost {h['lost_records']}, dropped {h['dropped']}")
        lines.append(f"    KV: {k['events']:,} events / {k['blocks']:,} blocks in {k['window_s']:.1f} s, "
                     f"{k['calls']:,} kv_events calls ({k['events_per_call']:.1f} events each), CPU {k['cpu_s']:.2f} s; "
                     f"index now {k['index_blocks']:,} blocks")
        w = r["with_kv_load"]
        lines.append(f"    routing, router alone: {r['requests']} requests at {r['rate']}/s, p50 {r['p50_ms']:.3f} p90 "
                     f"{r['p90_ms']:.3f} p99 {r['p99_ms']:.3f} max {r['max_ms']:.2f} ms; awaited coordinator calls "
                     f"{r['awaited'] or 0}; errors {r['errors'] or 0}")
        lines.append(f"    routing, KV events at the goal rate meanwhile (same 2 cores): p50 {w['p50_ms']:.3f} p90 "
                     f"{w['p90_ms']:.3f} p99 {w['p99_ms']:.3f} max {w['max_ms']:.2f} ms; awaited {w['awaited'] or 0}; "
                     f"errors {w['errors'] or 0}; keeping the index copy costs the router {r['index_upkeep_core']:.1%} of "
                     f"a core; decisions {r['decisions']}; router GC pauses {r['gc_pauses']} (max {r['gc_max_ms']:.1f} ms); "
                     f"route tables built meanwhile {r['route_builds']}")
        b = s["breaker_change"]
        lines.append(f"    one breaker opens: the coordinator answers a router's poll with a {b['answer']} of "
                     f"{b['answer_kb']:.0f} KB in {b['coordinator_call_ms']:.1f} ms; the router's refresh takes "
                     f"{b['router_refresh_ms']:.1f} ms (pair out of its routes: {b['pair_left_routes']})")
        lines.append(f"    index memory: owner {s['index_memory']['owner_bytes_per_block']:.0f} B/block, replica "
                     f"{s['index_memory']['replica_bytes_per_block']:.0f} B/block ({s['index_memory']['blocks_per_engine']} "
                     f"blocks/engine); route table {s['route_table_kb']:.0f} KB pickled, built in {s['route_build_ms']:.1f} ms")
        lines.append(f"    coordinator restart: warm router first route {x['warm_first_route_ms']:.1f} ms after the kill "
                     f"(awaited {x['warm_first_awaited'] or 0}); cold router first success "
                     f"{x.get('cold_first_route_ms', float('nan')):.0f} ms ({x['cold_attempts']} attempts, {x['cold_errors'] or 'no errors'}); "
                     f"warm view on the new incarnation, all engines back: {x.get('warm_view_new_epoch_ms', float('nan')):.0f} ms")
    lines += ["", "goals:"]
    for goal, measured, met in goals(res):
        lines.append(f"  [{'met' if met else 'MISSED'}] {goal}: {measured}")
    return "\n".join(lines)


def header(res: dict[str, Any]) -> str:
    h = res["host"]
    return (f"# {res['date']}\n# command: {res['command']}\n" + header_line(res['git']) + "\n"
            f"# host: {h['cpus']} CPUs, {h['platform']}; load average before {h['loadavg']}, after {h['loadavg_after']}; "
            f"wall {res['wall_s']:.1f} s\n")
