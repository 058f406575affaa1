"""`raypd` command line: `up`, `status`, `down`, `bench`.

  raypd up [--config configs/local.yaml] [--address ADDR] [--host H] [--port P]
      start (or join) Ray, launch the coordinator and the engines, serve the
      OpenAI API with Ray Serve, print the URL and one line per engine, wait;
      Ctrl-C / SIGTERM stops the app, the engines, the coordinator and (when
      `up` started it) the Ray cluster. A state file in the Ray temp dir lets
      `status` and `down` find the running service.
  raypd status [--json]   engines, roles, health, load, leases, breaker states
  raypd down              stop what `raypd up` started
  raypd bench ...         load test an OpenAI endpoint, or measure the front's overhead
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

COMMANDS = {
    "up": "start (or join) a Ray cluster, the coordinator and the engines, and serve the OpenAI API",
    "status": "show engines, roles, health, load, breaker states and in-flight transfers",
    "down": "stop the engines and the coordinator started by `raypd up`",
    "bench": "benchmark an OpenAI-compatible endpoint (TTFT/ITL/e2e, goodput) or the front's own overhead",
}
DEFAULT_CONFIG = "configs/local.yaml"
STATE_FILE = "raypd-up.json"


def build_parser() -> argparse.ArgumentParser:
    from serving.launcher import DEFAULT_TEMP_DIR

    parser = argparse.ArgumentParser(
        prog="raypd", description="Ray-native disaggregated prefill/decode LLM serving."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        if name in ("up", "status", "down"):
            cmd.add_argument("--config", default=None, help=f"deployment YAML (default {DEFAULT_CONFIG})")
            cmd.add_argument("--address", default=None, help="join an existing Ray cluster (e.g. auto, host:6379)")
            cmd.add_argument("--temp-dir", default=DEFAULT_TEMP_DIR,
                             help="Ray temp dir of a local cluster; also holds raypd's state file")
        if name == "up":
            cmd.add_argument("--host", default=None, help="HTTP host (default: the config's http.host)")
            cmd.add_argument("--port", type=int, default=None, help="HTTP port (default: the config's http.port)")
        if name == "status":
            cmd.add_argument("--json", action="store_true", help="print the status as JSON")
        if name == "bench":
            from serving.bench import add_arguments

            add_arguments(cmd)
    return parser


# ------------------------------------------------------------------ helpers
def _state_path(temp_dir: str) -> Path:
    return Path(temp_dir) / STATE_FILE


def _read_state(temp_dir: str) -> dict | None:
    try:
        return json.loads(_state_path(temp_dir).read_text())
    except (OSError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _load(args: argparse.Namespace, state: dict | None = None):
    from serving.config import load_config

    path = args.config or (state or {}).get("config") or DEFAULT_CONFIG
    cfg = load_config(path)
    updates = {}
    if getattr(args, "host", None):
        updates["host"] = args.host
    if getattr(args, "port", None) is not None:
        updates["port"] = args.port
    if updates:
        from serving.config import DeploymentConfig

        data = cfg.model_dump(mode="json")
        data["http"].update(updates)
        cfg = DeploymentConfig.from_dict(data)
    return cfg


def _engine_line(eid: str, stats: dict, summary: dict | None) -> str:
    role = stats.get("role") or (summary or {}).get("role", "?")
    if not stats.get("up", True):
        return f"  {role:<7} {eid:<32} DOWN  {stats.get('error', '')}"
    shape = ""
    if summary:
        shape = f"tp={summary.get('tp_size')} pp={summary.get('pp_size')} block={summary.get('block_size')}"
    blocks = ""
    if "free_blocks" in stats:
        blocks = f"free {stats['free_blocks']}/{stats.get('num_blocks', '?')} blocks"
    return (f"  {role:<7} {eid:<32} {'registered' if summary else 'NOT REGISTERED':<14} {shape:<24} "
            f"running {stats.get('running', 0):<4} leases {stats.get('held_leases', 0):<4} {blocks}")


def engine_lines(deployment: Any, timeout_s: float = 10.0) -> list[str]:
    import ray

    summaries = {}
    try:
        summaries = {e["engine_id"]: e for e in ray.get(deployment.coordinator.engines.remote(), timeout=timeout_s)}
    except Exception as exc:  # noqa: BLE001
        print(f"coordinator unavailable: {exc}", file=sys.stderr)
    lines = []
    for eid, handle in deployment.engines.items():
        try:
            stats = {"up": True, **ray.get(handle.stats.remote(), timeout=timeout_s)}
        except Exception as exc:  # noqa: BLE001
            stats = {"up": False, "error": f"{type(exc).__name__}"}
        lines.append(_engine_line(eid, stats, summaries.get(eid)))
    return lines


def _wait_healthy(url: str, timeout_s: float) -> dict | None:
    import httpx

    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url}/health", timeout=5)
            last = r.json()
            if r.status_code == 200:
                return last
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    return last


def _prepare_model(model: str) -> None:
    """Resolve (and on first use convert) the model folder before the engines start, showing progress."""
    try:
        from actors.models import resolve_model
    except ImportError:  # the model helpers are not there: the engines resolve the model themselves
        return
    import threading

    done = threading.Event()
    t0 = time.monotonic()

    def ticker() -> None:  # a live elapsed-time line while a long conversion runs
        while not done.wait(1.0):
            if sys.stdout.isatty():
                print(f"\r  preparing model {model!r}... {time.monotonic() - t0:.0f}s", end="", flush=True)

    thread = threading.Thread(target=ticker, daemon=True)
    thread.start()
    try:
        path = resolve_model(model, progress=lambda msg: print(f"\rraypd: {msg}", flush=True))
    finally:
        done.set()
        thread.join()
    print(f"\rraypd: model {model!r} -> {path}", flush=True)


# ---------------------------------------------------------------------- up
def cmd_up(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from serving.app import build_app
    from serving.config import ConfigError
    from serving.launcher import init_ray, launch, shutdown_deployment

    try:
        cfg = _load(args)
    except ConfigError as exc:
        print(f"raypd up: {exc}", file=sys.stderr)
        return 2
    existing = _read_state(args.temp_dir)
    if existing and _pid_alive(int(existing.get("pid", -1))):
        print(f"raypd up: already running (pid {existing['pid']}, {existing.get('url')}); "
              f"use `raypd down` first", file=sys.stderr)
        return 1

    stop = {"requested": False}

    def request_stop(signum: int, _frame: Any) -> None:
        if not stop["requested"]:
            print(f"\nraypd: {signal.Signals(signum).name} received, shutting down...", flush=True)
        stop["requested"] = True

    def install_handlers() -> None:
        signal.signal(signal.SIGINT, request_stop)
        signal.signal(signal.SIGTERM, request_stop)

    install_handlers()
    started_cluster = False
    url = f"http://{cfg.http.host}:{cfg.http.port}"
    try:
        started_cluster = init_ray(cfg, args.address, args.temp_dir)
        install_handlers()  # Ray's core worker installs its own SIGTERM handler (logs and dies): take it back
        where = "started a local Ray cluster" if started_cluster else "joined Ray cluster"
        print(f"raypd: {where} ({ray.get_runtime_context().gcs_address})", flush=True)
        if cfg.backend == "vllm":
            _prepare_model(cfg.model)
        n = cfg.prefill.count + cfg.decode.count
        print(f"raypd: launching {cfg.name}: {cfg.prefill.count} prefill + {cfg.decode.count} decode "
              f"{cfg.backend} engine(s)...", flush=True)
        t0 = time.monotonic()
        dep = launch(cfg)
        print(f"raypd: {n} engine(s) up in {time.monotonic() - t0:.1f}s", flush=True)
        if stop["requested"]:
            return 130
        serve.start(http_options={"host": cfg.http.host, "port": cfg.http.port})
        serve.run(build_app(cfg.model_dump(mode="json")), name=cfg.name, route_prefix="/", blocking=False)
        health = _wait_healthy(url, 120.0)
        _state_path(args.temp_dir).parent.mkdir(parents=True, exist_ok=True)
        _state_path(args.temp_dir).write_text(json.dumps({
            "pid": os.getpid(), "name": cfg.name, "url": url, "config": args.config or DEFAULT_CONFIG,
            "gcs_address": ray.get_runtime_context().gcs_address, "started_cluster": started_cluster,
        }))
        state = "ready" if health and health.get("healthy") else f"NOT ready ({(health or {}).get('reason')})"
        print(f"raypd: serving model {cfg.served_model_name!r} at {url}/v1 ({state})", flush=True)
        for line in engine_lines(dep):
            print(line, flush=True)
        print("raypd: Ctrl-C to stop", flush=True)
        while not stop["requested"]:
            time.sleep(0.2)
        return 0
    except Exception as exc:  # noqa: BLE001 - report, then clean up below
        print(f"raypd up failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not strand processes
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if ray.is_initialized():
            try:
                if started_cluster:
                    serve.shutdown()
                else:
                    serve.delete(cfg.name)
            except Exception as exc:  # noqa: BLE001
                print(f"raypd: serve shutdown: {exc}", file=sys.stderr)
            try:
                stopped = shutdown_deployment(cfg.name)
                print(f"raypd: stopped {len(stopped)} engine(s)", flush=True)
            except Exception as exc:  # noqa: BLE001
                print(f"raypd: engine shutdown: {exc}", file=sys.stderr)
            ray.shutdown()
        try:
            state = _read_state(args.temp_dir)
            if state and state.get("pid") == os.getpid():
                _state_path(args.temp_dir).unlink()
        except OSError:
            pass
        print("raypd: stopped", flush=True)


# ------------------------------------------------------------------ status
def _connect(args: argparse.Namespace, state: dict | None) -> bool:
    import ray

    from serving.launcher import init_ray

    address = args.address or (state or {}).get("gcs_address")
    if not address:
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    init_ray(None, address=address)
    return ray.is_initialized()


def collect_status(name: str, timeout_s: float = 10.0) -> dict:
    import ray

    from actors.coordinator import COORDINATOR_NAME, NAMESPACE
    from serving.launcher import find_engines

    out: dict[str, Any] = {"deployment": name, "engines": {}, "coordinator": None, "serve": None}
    try:
        coordinator = ray.get_actor(COORDINATOR_NAME, namespace=NAMESPACE)
        registered = {e["engine_id"]: e for e in ray.get(coordinator.engines.remote(), timeout=timeout_s)}
        out["coordinator"] = "up"
    except (ValueError, ray.exceptions.RayError) as exc:
        registered = {}
        out["coordinator"] = f"unavailable: {exc}"
    for actor, handle in sorted(find_engines(name).items()):
        entry: dict[str, Any] = {"actor": actor}
        try:
            entry["healthy"] = bool(ray.get(handle.check_health.remote(), timeout=timeout_s))
            entry["stats"] = ray.get(handle.stats.remote(), timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001
            entry["healthy"] = False
            entry["error"] = f"{type(exc).__name__}: {exc}"
        eid = (entry.get("stats") or {}).get("engine_id") or actor.removeprefix("raypd-")
        entry["registered"] = eid in registered
        entry["summary"] = registered.get(eid)
        out["engines"][eid] = entry
    try:
        from ray import serve

        from serving.app import INGRESS_NAME

        handle = serve.get_deployment_handle(INGRESS_NAME, app_name=name)
        out["serve"] = handle.status.remote().result(timeout_s=timeout_s)
    except Exception as exc:  # noqa: BLE001 - no Serve app: engines only
        out["serve_error"] = f"{type(exc).__name__}: {exc}"
    return out


def print_status(status: dict, url: str | None) -> None:
    print(f"deployment {status['deployment']}" + (f" at {url}" if url else ""))
    print(f"coordinator: {status['coordinator']}")
    serve_info = status.get("serve") or {}
    health = serve_info.get("health")
    if health:
        print(f"front: {'healthy' if health['healthy'] else 'UNHEALTHY: ' + str(health.get('reason'))}")
    else:
        print(f"front: not reachable ({status.get('serve_error', 'no Serve app')})")
    print("engines:")
    router = serve_info.get("router") or {}
    for eid, e in status["engines"].items():
        s = e.get("stats") or {}
        summary = e.get("summary") or {}
        load = (router.get("decode_load") or {}).get(eid) or (router.get("prefill_load") or {}).get(eid) or {}
        print(f"  {s.get('role', summary.get('role', '?')):<7} {eid:<30} "
              f"{'healthy' if e.get('healthy') else 'UNHEALTHY':<9} "
              f"{'registered' if e.get('registered') else 'unregistered':<12} "
              f"tp={summary.get('tp_size', '?')} running={s.get('running', '?')} "
              f"routed_in_flight={load.get('requests', 0)} leases={s.get('held_leases', '?')} "
              f"free_blocks={s.get('free_blocks', '?')}/{s.get('num_blocks', '?')}"
              + (f"  error: {e['error']}" if e.get("error") else ""))
    breakers = router.get("breakers") or {}
    print("breakers (prefill->decode):" + ("" if breakers else " none yet"))
    for pair, b in sorted(breakers.items()):
        print(f"  {pair:<50} {b['state']:<9} failures={b['consecutive_failures']} opened={b['opened_count']}")
    if router.get("counters"):
        print("router: " + " ".join(f"{k}={v}" for k, v in sorted(router["counters"].items()))
              + "".join(f" fallback[{k}]={v}" for k, v in sorted((router.get("fallbacks") or {}).items())))


def cmd_status(args: argparse.Namespace) -> int:
    import ray

    state = _read_state(args.temp_dir)
    if not _connect(args, state):
        print("raypd status: no running raypd found (start one with `raypd up`, or pass --address)",
              file=sys.stderr)
        return 1
    try:
        name = (state or {}).get("name") or _load(args, state).name
        status = collect_status(name)
        if args.json:
            print(json.dumps(status, indent=2, default=str))
        else:
            print_status(status, (state or {}).get("url"))
        return 0 if status["engines"] else 1
    finally:
        ray.shutdown()


# -------------------------------------------------------------------- down
def cmd_down(args: argparse.Namespace) -> int:
    import ray

    state = _read_state(args.temp_dir)
    if state and _pid_alive(int(state["pid"])) and not args.address:
        pid = int(state["pid"])
        print(f"raypd down: stopping `raypd up` (pid {pid})...", flush=True)
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 120
        while _pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.3)
        if _pid_alive(pid):
            print(f"raypd down: pid {pid} is still running after 120s", file=sys.stderr)
            return 1
        print("raypd down: stopped", flush=True)
        return 0
    if not _connect(args, state):
        print("raypd down: nothing to stop (no state file; pass --address to clean a cluster)", file=sys.stderr)
        return 1
    try:
        from ray import serve

        from serving.launcher import shutdown_deployment

        name = (state or {}).get("name") or _load(args, state).name
        try:
            serve.delete(name)
        except Exception as exc:  # noqa: BLE001 - no Serve app
            print(f"raypd down: no Serve app {name!r} ({type(exc).__name__})", file=sys.stderr)
        stopped = shutdown_deployment(name)
        print(f"raypd down: stopped {len(stopped)} engine(s) of {name}", flush=True)
        return 0
    finally:
        ray.shutdown()
        if state:
            _state_path(args.temp_dir).unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "bench":
        from serving.bench import run

        return run(args)
    return {"up": cmd_up, "status": cmd_status, "down": cmd_down}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
