"""What `raypd up` prints about its engines and what `raypd status` collects and prints.

Engines are asked over Ray (stats, health, start-up phases, the vLLM config they
actually run with); the ingress replica's router state comes through a Serve
deployment handle. Nothing here is periodic: `up` polls phases only while the
engines start (serving.cluster.launcher), `status` asks once.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

from actors.engine.startup import StartPhase
from actors.protocol.registration import EngineSummary
from actors.protocol.stats import EngineStats
from serving.routing.status import jsonable


def phase_line(phase: StartPhase, t0_wall: float) -> str:
    """One line per engine per start-up phase, with seconds since the launch began."""
    detail = f"  {phase.detail}" if phase.detail else ""
    return f"raypd:   {phase.engine_id:<28} {phase.phase:<20} {max(0.0, phase.at - t0_wall):6.1f}s{detail}"


def _engine_line(eid: str, stats: EngineStats | None, error: str | None, summary: EngineSummary | None,
                 vllm: dict | None) -> str:
    role = stats.role if stats is not None else summary.role if summary is not None else "?"
    if stats is None:
        return f"  {role:<7} {eid:<32} DOWN  {error or ''}"
    shape = ""
    if summary is not None:
        shape = f"tp={summary.tp_size} pp={summary.pp_size} block={summary.block_size}"
    b = stats.backend
    line = (f"  {role:<7} {eid:<32} {'registered' if summary else 'NOT REGISTERED':<14} {shape:<24} "
            f"running {stats.running:<4} leases {b.held_leases:<4} free {b.free_blocks}/{b.num_blocks} blocks")
    return line + (f"\n          vllm: {vllm_summary(vllm)}" if vllm else "")


def vllm_summary(v: dict) -> str:
    return (f"dtype={v['dtype']} max_model_len={v['max_model_len']} max_num_seqs={v['max_num_seqs']} "
            f"max_num_batched_tokens={v['max_num_batched_tokens']} block_size={v['block_size']} "
            f"prefix_caching={'on' if v['enable_prefix_caching'] else 'off'} "
            f"cuda_graphs/compile={'off' if v['enforce_eager'] else 'on'} kv_role={v['kv_role']} "
            f"async_scheduling={'on' if v.get('async_scheduling') else 'off'}")


def _effective(handle: Any, timeout_s: float) -> dict | None:
    import ray

    value = ray.get(handle.effective_config.remote(), timeout=timeout_s)
    return dataclasses.asdict(value) if value is not None else None


def engine_lines(deployment: Any, timeout_s: float = 10.0) -> list[str]:
    import ray

    summaries = {}
    try:
        summaries = {e.engine_id: e for e in ray.get(deployment.coordinator.engines.remote(), timeout=timeout_s)}
    except Exception as exc:  # noqa: BLE001
        print(f"coordinator unavailable: {exc}", file=sys.stderr)
    lines = []
    for eid, handle in deployment.engines.items():
        vllm, stats, error = None, None, None
        try:
            stats = ray.get(handle.stats.remote(), timeout=timeout_s)
            vllm = _effective(handle, timeout_s)
        except Exception as exc:  # noqa: BLE001
            error = type(exc).__name__
        lines.append(_engine_line(eid, stats, error, summaries.get(eid), vllm))
    return lines


def collect_status(name: str, timeout_s: float = 10.0) -> dict:
    """Everything `raypd status` shows, as JSON values (`--json` prints it as it is)."""
    import ray

    from actors.ray_names import COORDINATOR_NAME, NAMESPACE
    from serving.cluster.engines import find_engines

    out: dict[str, Any] = {"deployment": name, "engines": {}, "coordinator": None, "serve": None, "breakers": {}}
    try:
        coordinator = ray.get_actor(COORDINATOR_NAME, namespace=NAMESPACE)
        registered = {e.engine_id: jsonable(e) for e in ray.get(coordinator.engines.remote(), timeout=timeout_s)}
        out["coordinator"] = "up"
        ledger = ray.get(coordinator.transfers.remote(), timeout=timeout_s)  # the one owner of the breakers
        out["handoffs_in_flight"], out["verdicts"] = ledger.in_flight, ledger.verdicts
        out["handoffs_awaiting_units"] = ledger.awaiting_units
        out["breakers"] = {b.pair: jsonable(b) for b in ledger.breakers}
        # what the control plane absorbed (ledger batches, KV events, route tables built and polled)
        out["control_plane"] = jsonable(ray.get(coordinator.control_stats.remote(), timeout=timeout_s))
    except (ValueError, ray.exceptions.RayError) as exc:
        registered = {}
        out["coordinator"] = f"unavailable: {exc}"
    for actor, handle in sorted(find_engines(name).items()):
        entry: dict[str, Any] = {"actor": actor}
        try:
            entry["healthy"] = bool(ray.get(handle.check_health.remote(), timeout=timeout_s))
            entry["stats"] = jsonable(ray.get(handle.stats.remote(), timeout=timeout_s))
            entry["vllm_config"] = _effective(handle, timeout_s)
        except Exception as exc:  # noqa: BLE001
            entry["healthy"] = False
            entry["error"] = f"{type(exc).__name__}: {exc}"
        eid = (entry.get("stats") or {}).get("engine_id") or actor.removeprefix("raypd-")
        entry["registered"] = eid in registered
        entry["summary"] = registered.get(eid)
        out["engines"][eid] = entry
    from serving.cluster.launcher import find_autoscaler, find_launcher

    scaler = find_autoscaler(name)
    if scaler is not None:
        try:
            out["autoscaler"] = ray.get(scaler.status.remote(), timeout=timeout_s)
        except ray.exceptions.RayError as exc:
            out["autoscaler_error"] = f"{type(exc).__name__}: {exc}"
    launcher = find_launcher(name)
    if launcher is not None:  # engines replaced because their node died (serving.cluster.node_loss)
        try:
            out["node_loss"] = jsonable(ray.get(launcher.node_loss_events.remote(), timeout=timeout_s))
        except ray.exceptions.RayError as exc:
            out["node_loss_error"] = f"{type(exc).__name__}: {exc}"
    try:
        from ray import serve

        from serving.cluster.app import INGRESS_NAME

        handle = serve.get_deployment_handle(INGRESS_NAME, app_name=name)
        out["serve"] = jsonable(handle.status.remote().result(timeout_s=timeout_s))
    except Exception as exc:  # noqa: BLE001 - no Serve app: engines only
        out["serve_error"] = f"{type(exc).__name__}: {exc}"
    from serving.ops.cluster_metrics import scrape_urls

    out["metrics_urls"] = scrape_urls()
    return out


def print_status(status: dict, url: str | None) -> None:
    print(f"deployment {status['deployment']}" + (f" at {url}" if url else ""))
    print(f"coordinator: {status['coordinator']}")
    serve_info = status.get("serve") or {}
    ready = serve_info.get("readiness")
    if ready:
        shown = ("healthy" + (f" ({ready['reason']})" if ready.get("reason") else "")) if ready["ready"] else (
            "NOT READY: " + str(ready.get("reason")))
        print(f"front: {shown}")
    else:
        print(f"front: not reachable ({status.get('serve_error', 'no Serve app')})")
    print("engines:")
    router = serve_info.get("router") or {}
    for eid, e in status["engines"].items():
        s = e.get("stats") or {}
        b = s.get("backend") or {}
        summary = e.get("summary") or {}
        load = (router.get("decode_load") or {}).get(eid) or (router.get("prefill_load") or {}).get(eid) or {}
        print(f"  {s.get('role', summary.get('role', '?')):<7} {eid:<30} "
              f"{'healthy' if e.get('healthy') else 'UNHEALTHY':<9} "
              f"{'registered' if e.get('registered') else 'unregistered':<12} "
              f"tp={summary.get('tp_size', '?')} running={s.get('running', '?')} "
              f"routed_in_flight={load.get('requests', 0)} leases={b.get('held_leases', '?')} "
              f"free_blocks={b.get('free_blocks', '?')}/{b.get('num_blocks', '?')}"
              + (f"  error: {e['error']}" if e.get("error") else ""))
        if e.get("vllm_config"):
            print(f"          vllm: {vllm_summary(e['vllm_config'])}")
    for e in (status.get("node_loss") or [])[-10:]:
        when = time.strftime("%H:%M:%S", time.localtime(e["t"]))
        print(f"node loss {when}  {e['engine']:<36} {e['step']}" + (f": {e['detail']}" if e.get("detail") else ""))
    if status.get("autoscaler") is not None:
        from serving.cluster.autoscaler import status_lines

        print("\n".join(status_lines(status["autoscaler"])))
    breakers = status.get("breakers") or {b["prefill_id"] + "->" + b["decode_id"]: b for b in router.get("breakers", ())}
    print("breakers (prefill->decode, held by the coordinator's ledger):" + ("" if breakers else " none yet"))
    for pair, b in sorted(breakers.items()):
        last = f"  last: {b['last_reason']}" if b.get("last_reason") else ""
        print(f"  {pair:<50} {b['state']:<9} failures={b.get('failures', 0)} opened={b['opened_count']}{last}")
    for pair, rate in sorted((router.get("pull_rates") or {}).items()):
        failed = rate.get("failure_penalty_s") or 0.0
        print(f"  learned pull {pair:<44} {rate['tokens_per_s']:.0f} tokens/s + {rate['overhead_s'] * 1e3:.0f} ms"
              + (f" (of which {failed * 1e3:.0f} ms left of a failed pull's cost)" if failed else ""))
    if router.get("counters"):
        print("router: " + " ".join(f"{k}={v}" for k, v in sorted(router["counters"].items()))
              + "".join(f" fallback[{k}]={v}" for k, v in sorted((router.get("fallbacks") or {}).items()))
              + "".join(f" migrated[{k}]={v}" for k, v in sorted((router.get("migrations") or {}).items())))
    planner = router.get("planner") or {}
    if planner.get("decisions"):
        print("prefill decisions (this replica): " + " ".join(
            f"{k.replace('->', '/')}={v}" for k, v in sorted(planner["decisions"].items())))
    if planner.get("prefix_index_engines") is not None:
        print("prefix index (blocks per engine): " + (" ".join(
            f"{e}={n}" for e, n in sorted(planner["prefix_index_engines"].items())) or "empty")
            + (f"  error: {planner['prefix_index_error']}" if planner.get("prefix_index_error") else ""))
    print("metrics (Prometheus, one URL per node; ray_raypd_* and ray_vllm_*): "
          + (" ".join(status.get("metrics_urls") or []) or "no node exports metrics"))
