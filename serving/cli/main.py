"""`raypd` command line: `up`, `config`, `status`, `down`, `bench`.

  raypd up [--model PATH_OR_ID] [--prefill N --decode M --prefill-tp X --decode-tp Y]
           [--engine-arg KEY=VALUE ...] [--config FILE] [--address ADDR] [--host H] [--port P] [-v]
      start (or join) Ray, launch the coordinator and the engines (one line per
      engine per start-up phase), serve the OpenAI API with Ray Serve, print the
      URL, the engines and where the logs are, wait; Ctrl-C / SIGTERM stops the
      app, the engines, the coordinator and (when `up` started it) the Ray
      cluster. No flag: the embedded default (configs/local.yaml). A state file
      in a per-user folder lets `status` and `down` find the running service.
  raypd config [same deployment flags]   print the deployment YAML `up` would use
  raypd config --plan [--profile P --slo-ttft-s S --rates R,...]   the engine shape with the most
      goodput within the targets, as that deployment (serving/cli/plan.py)
  raypd profile [--out P]  the running engines' measured rates, a profile for config --plan
  raypd status [--json]   engines, roles, health, load, leases, breaker states, vLLM settings
  raypd down              stop what `raypd up` started (after checking the pid is that `raypd up`)
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
from typing import TYPE_CHECKING, Any

from serving.cli import runstate
from serving.cli.attach import attach

if TYPE_CHECKING:
    from serving.config import DeploymentConfig

COMMANDS = {
    "up": "start (or join) a Ray cluster, the coordinator and the engines, and serve the OpenAI API",
    "config": "print the deployment YAML that `raypd up` would use with the same flags",
    "status": "show engines, roles, health, load, breaker states and in-flight transfers",
    "down": "stop the engines and the coordinator started by `raypd up`",
    "profile": "measure the running engines' rates under a 4-minute load: a profile for `raypd config --plan`",
    "bench": "benchmark an OpenAI-compatible endpoint (TTFT/ITL/e2e, goodput) or the front's own overhead",
}
DEFAULT_CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "local.yaml")


def build_parser() -> argparse.ArgumentParser:
    from serving.cluster.ray_init import DEFAULT_TEMP_DIR
    from serving.cli.quickstart import add_arguments as add_deployment_flags

    parser = argparse.ArgumentParser(
        prog="raypd", description="Ray-native disaggregated prefill/decode LLM serving."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        if name in ("up", "config", "status", "down", "profile"):
            cmd.add_argument("--config", default=None, help="deployment YAML (default: configs/local.yaml, "
                                                            "or the one built from the flags)")
            cmd.add_argument("--address", default=None, help="join an existing Ray cluster (e.g. auto, host:6379)")
        if name in ("up", "status", "down", "profile"):
            cmd.add_argument("--temp-dir", default=DEFAULT_TEMP_DIR, help="Ray temp dir of a local cluster")
        if name in ("up", "config"):
            add_deployment_flags(cmd)
            cmd.add_argument("--host", default=None, help="HTTP host (default: the config's http.host)")
            cmd.add_argument("--port", type=int, default=None, help="HTTP port (default: the config's http.port)")
        if name == "config":
            from serving.cli.plan import add_arguments as add_plan_flags

            add_plan_flags(cmd)
        if name == "up":
            cmd.add_argument("-v", "--verbose", action="store_true", help="stream the engines' logs here")
        if name == "profile":
            from serving.cli.profile import add_arguments as add_profile_flags

            add_profile_flags(cmd)
        if name == "status":
            cmd.add_argument("--json", action="store_true", help="print the status as JSON")
        if name == "bench":
            from serving.bench.command import add_arguments

            add_arguments(cmd)
    return parser


# ------------------------------------------------------------------ helpers
def _load(args: argparse.Namespace, state: runstate.UpState | None = None):
    """The deployment: a config file, the flags (over the file, if any), or the embedded default."""
    from serving.config import DeploymentConfig, load_config, read_config_file
    from serving.cli.quickstart import deployment_from_flags, uses_flags

    path = args.config or (state.config if state else None)
    if uses_flags(args):
        cfg = deployment_from_flags(args, read_config_file(path) if path else None)
    else:
        cfg = load_config(path or DEFAULT_CONFIG)
    updates = {}
    if getattr(args, "host", None):
        updates["host"] = args.host
    if getattr(args, "port", None) is not None:
        updates["port"] = args.port
    if updates:
        data = cfg.model_dump(mode="json")
        data["http"].update(updates)
        cfg = DeploymentConfig.from_dict(data)
    return cfg


def _checked(args: argparse.Namespace, command: str):
    """The deployment, its engine_kwargs checked against vLLM's classes; None after printing why not."""
    from serving.config import ConfigError, check_engine_args

    try:
        cfg = _load(args)
        for note in check_engine_args(cfg):
            print(f"raypd {command}: note: {note}", file=sys.stderr)
    except ConfigError as exc:
        print(f"raypd {command}: {exc}", file=sys.stderr)
        return None
    return cfg


def _wait_healthy(url: str, timeout_s: float) -> dict | None:
    """The front's readiness once ready, else its last answer (None: it never answered)."""
    from serving.ops.health_probe import NotHealthy, wait_healthy

    try:
        return wait_healthy(url, timeout_s, interval_s=0.5)
    except NotHealthy as exc:
        return exc.last


def _prepare_model(model: str) -> None:
    """Resolve (and on first use convert) the model before Ray starts: a bad model fails at once."""
    from actors.models.local import resolve_model

    path = resolve_model(model, progress=lambda msg: print(f"raypd: {msg}", flush=True))
    print(f"raypd: model {model!r} -> {path}", flush=True)


def _api_keys(cfg: Any, joining: bool) -> Any:
    """Check the keys this process sees; when it has some, replicas must find them too (fail closed)."""
    from serving.front.api_keys import ENV_VAR, is_loopback, load_api_keys

    keys = load_api_keys(cfg.http)
    if keys:
        if joining and ENV_VAR in keys.sources:
            print(f"raypd up: note: ingress replicas read {ENV_VAR} from their Ray node's environment; on a "
                  f"cluster you join, set it where `ray start` ran (or use http.api_keys_file)", file=sys.stderr)
        print(f"raypd: API keys required ({len(keys.keys)} from {', '.join(keys.sources)})", flush=True)
        if not cfg.http.require_api_keys:
            data = cfg.model_dump(mode="json")
            data["http"]["require_api_keys"] = True
            cfg = type(cfg).from_dict(data)
    elif not is_loopback(cfg.http.host):
        print(f"raypd up: WARNING: serving on {cfg.http.host} with no API key: anyone who reaches port "
              f"{cfg.http.port} can use the model (set {ENV_VAR} or http.api_keys_file)", file=sys.stderr)
    return cfg


def _auth_line() -> str:
    from serving.cluster.ray_init import ray_auth_mode

    if ray_auth_mode() != "token":
        return "Ray token authentication off"
    where = ("RAY_AUTH_TOKEN" if os.environ.get("RAY_AUTH_TOKEN")
             else os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token"))
    return f"Ray token authentication on (token: {where})"


# ---------------------------------------------------------------------- up
def cmd_up(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from serving.front.api_keys import ApiKeyError
    from serving.cluster.app import build_app
    from serving.cli.status import engine_lines, phase_line
    from serving.cluster.ray_init import init_ray, ray_auth_mode, ray_logs_dir
    from serving.cluster.launcher import launch, shutdown_deployment

    cfg = _checked(args, "up")
    if cfg is None:
        return 2
    existing = runstate.read_state(args.temp_dir)
    if existing and runstate.live_up_process(existing) is None:
        print(f"raypd up: already running (pid {existing.pid}, {existing.url}); use `raypd down` first",
              file=sys.stderr)
        return 1
    try:
        cfg = _api_keys(cfg, joining=bool(args.address or cfg.ray.address))
        if cfg.backend == "vllm":
            _prepare_model(cfg.model)
    except (ApiKeyError, OSError, ValueError, RuntimeError) as exc:
        print(f"raypd up: {exc}", file=sys.stderr)
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
        started_cluster = init_ray(cfg, args.address, args.temp_dir, log_to_driver=args.verbose)
        install_handlers()  # Ray's core worker installs its own SIGTERM handler (logs and dies): take it back
        where = "started a local Ray cluster" if started_cluster else "joined Ray cluster"
        print(f"raypd: {where} ({ray.get_runtime_context().gcs_address}; {_auth_line()})", flush=True)
        # recorded before the engines start, so that `raypd down` can stop a launch in progress
        runstate.write_state(args.temp_dir, runstate.UpState(
            pid=os.getpid(), create_time=runstate.process_create_time(os.getpid()), name=cfg.name, url=url,
            config=args.config, gcs_address=ray.get_runtime_context().gcs_address,
            started_cluster=started_cluster, ray_auth_mode=ray_auth_mode()))
        n = cfg.prefill.count + cfg.decode.count + cfg.both.count
        print(f"raypd: launching {cfg.name}: {engine_counts(cfg)} {cfg.backend} engine(s)...", flush=True)
        t0, t0_wall = time.monotonic(), time.time()
        dep = launch(cfg, on_phase=lambda phase: print(phase_line(phase, t0_wall), flush=True))
        print(f"raypd: {n} engine(s) up in {time.monotonic() - t0:.1f}s", flush=True)
        if stop["requested"]:
            return 130
        serve.start(http_options={"host": cfg.http.host, "port": cfg.http.port})
        serve.run(build_app(cfg.model_dump(mode="json")), name=cfg.name, route_prefix="/", blocking=False)
        health = _wait_healthy(url, 120.0)
        state = "ready" if health and health.get("ready") else f"NOT ready ({(health or {}).get('reason')})"
        print(f"raypd: serving model {cfg.served_model_name!r} at {url}/v1 ({state})", flush=True)
        for line in engine_lines(dep):
            print(line, flush=True)
        streamed = "streamed here" if args.verbose else "--verbose streams them here"
        print(f"raypd: logs in {ray_logs_dir()} (engines: worker-*.out/.err, {streamed}); Ctrl-C to stop",
              flush=True)
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
        runstate.remove_state(args.temp_dir, pid=os.getpid())
        print("raypd: stopped", flush=True)


def cmd_config(args: argparse.Namespace) -> int:
    from serving.cli.quickstart import config_yaml

    cfg = _checked(args, "config")
    if cfg is None:
        return 2
    if args.plan:
        from serving.cli.plan import run_plan

        return run_plan(args, cfg)
    print(config_yaml(cfg), end="")
    return 0


# ------------------------------------------------------------------ status
def _jsonable(obj: Any) -> Any:
    import dataclasses

    return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else str(obj)


def cmd_profile(args: argparse.Namespace) -> int:
    import ray

    from serving.cli.profile import run

    state = runstate.read_state(args.temp_dir)
    if not attach(args, state, "profile"):
        return 1
    try:
        cfg = _load(args, state)
        return run(args, cfg, state.url if state else f"http://{cfg.http.host}:{cfg.http.port}")
    finally:
        ray.shutdown()


def cmd_status(args: argparse.Namespace) -> int:
    import ray

    from serving.cli.status import collect_status, print_status

    state = runstate.read_state(args.temp_dir)
    if not attach(args, state, "status"):
        return 1
    try:
        name = state.name if state else _load(args).name
        status = collect_status(name)
        if args.json:
            print(json.dumps(status, indent=2, default=_jsonable))
        else:
            print_status(status, state.url if state else None)
        return 0 if status["engines"] else 1
    finally:
        ray.shutdown()


# -------------------------------------------------------------------- down
def _stop_up_process(state: runstate.UpState) -> int:
    print(f"raypd down: stopping `raypd up` (pid {state.pid})...", flush=True)
    os.kill(state.pid, signal.SIGTERM)
    deadline = time.monotonic() + 120
    while runstate.live_up_process(state) is None and time.monotonic() < deadline:
        time.sleep(0.3)
    if runstate.live_up_process(state) is None:
        print(f"raypd down: pid {state.pid} is still running after 120s", file=sys.stderr)
        return 1
    print("raypd down: stopped", flush=True)
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    import ray

    state = runstate.read_state(args.temp_dir)
    if state is not None and not args.address:
        why_not = runstate.live_up_process(state)
        if why_not is None:
            return _stop_up_process(state)
        print(f"raypd down: not signalling: {why_not}; the record is stale", file=sys.stderr)
        if state.started_cluster:  # that cluster ended with its `raypd up`: nothing left to clean
            runstate.remove_state(args.temp_dir)
            return 0
    if not attach(args, state, "down", "nothing to stop (no state file; pass --address to clean a cluster)"):
        return 1
    try:
        from ray import serve

        from serving.cluster.launcher import shutdown_deployment

        name = state.name if state else _load(args).name
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
            runstate.remove_state(args.temp_dir)


def engine_counts(cfg: DeploymentConfig) -> str:
    """"2 both", "1 prefill + 2 decode": each role that has engines."""
    counts = [(cfg.prefill.count, "prefill"), (cfg.decode.count, "decode"), (cfg.both.count, "both")]
    return " + ".join(f"{n} {role}" for n, role in counts if n) or "0"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if args.command == "bench":
        from serving.bench.command import run

        return run(args)
    commands = {"up": cmd_up, "config": cmd_config, "status": cmd_status, "down": cmd_down, "profile": cmd_profile}
    return commands[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
