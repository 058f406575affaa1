"""`raypd bench --overhead`: what the HTTP front adds to the P/D path, measured side by side.

Starts its own local Ray cluster with the synthetic backend (`--config`,
default configs/synthetic.yaml), then runs the same P/D requests (prefill on a
prefill engine, stream from the decode engine) as direct actor calls from this
process, through the Serve-hosted front (HTTP -> Serve proxy -> ingress
replica: FastAPI + router -> actors) and through the same app under plain
uvicorn in a child process (no Serve proxy hop). The sequential requests go to
the columns in turn, round after round, so load from elsewhere on the machine
falls on every column alike. Prints p50/p90 latency, TTFT and requests/s side
by side with the difference and the ratio to the direct call, and what each
front adds before the first token (TTFT p50 through the front minus the direct
call's). `--results` (default
benchmarks/results/front_overhead.json, + .txt) records them with the command
and the host's state.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from typing import Any

from serving.bench.samples import Sample, closed_loop, free_port, host_state, make_prompt, percentile, write_results
from serving.bench.sse import stream_request
from serving.ops.health_probe import wait_healthy


async def direct_request(prefill: Any, decode: Any, i: int, prompt: str, max_tokens: int) -> Sample:
    """The P/D path without the front: the prefill actor's first token, then the decode actor's stream
    (the same continuation the router runs)."""
    from actors.protocol.request import EngineRequest, SamplingSpec
    from actors.engine.synthetic.tokenizer import encode_text

    t0 = time.perf_counter()
    req = EngineRequest(f"direct-{i}-{time.monotonic_ns()}", SamplingSpec(max_tokens=max_tokens),
                        prompt_token_ids=tuple(encode_text(prompt)))
    sample = Sample(ok=False)
    try:
        pre = await prefill.prefill.remote(req)
        last = sample.ttft = time.perf_counter() - t0
        last += t0
        sample.output_tokens = len(pre.first_token_ids)
        if pre.needs_decode:
            async for ref in decode.generate.options(num_returns="streaming").remote(pre.continuation(req)):
                chunk = await ref
                if chunk.failed:
                    sample.error = chunk.error
                    return sample
                now = time.perf_counter()
                sample.itls.append(now - last)
                last = now
                sample.output_tokens += len(chunk.token_ids)
        sample.e2e = time.perf_counter() - t0
        sample.ok = True
    except Exception as exc:  # noqa: BLE001
        sample.error = f"{type(exc).__name__}: {exc}"
    return sample


async def measure_overhead(args: argparse.Namespace, dep: Any, fronts: dict[str, str], model: str) -> dict:
    """Same requests: direct actor calls, then through each front (name -> base URL)."""
    import httpx

    rng = random.Random(args.seed)
    prompt = make_prompt(args.prompt_len, rng)
    prefills = list(dep.prefills.values())
    decodes = list(dep.decodes.values())

    async def direct(i: int) -> Sample:
        return await direct_request(prefills[i % len(prefills)], decodes[i % len(decodes)], i, prompt,
                                    args.output_len)

    c_hi = args.overhead_concurrency
    limits = httpx.Limits(max_connections=c_hi + 4, max_keepalive_connections=c_hi + 4)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        body = {"model": model, "prompt": prompt, "max_tokens": args.output_len, "stream": True}

        def via(url: str) -> Any:
            async def front(i: int) -> Sample:
                return await stream_request(client, url, body, {}, False, Sample(ok=False))
            return front

        workers = {"direct": direct, **{name: via(url) for name, url in fronts.items()}}
        for worker in workers.values():
            await closed_loop(worker, 2, 20)  # warm-up: handshakes, connections, code paths
        # Latency: one request per column in turn, round after round, so the shared machine's
        # load drifts over every column alike; the order within a round rotates.
        seq: dict[str, list[Sample]] = {name: [] for name in workers}
        names = list(workers)
        for i in range(args.requests):
            for name in names[i % len(names):] + names[:i % len(names)]:
                seq[name].append(await workers[name](i))
        out: dict[str, Any] = {}
        for name, worker in workers.items():
            par, wall_hi = await closed_loop(worker, c_hi, args.requests * 2)
            errors = [s.error for s in seq[name] + par if not s.ok]
            if errors:
                raise RuntimeError(f"{name}: {len(errors)} requests failed, first: {errors[0]}")
            e2e = [s.e2e for s in seq[name]]
            out[name] = {"p50_ms": percentile(e2e, 50) * 1000, "p90_ms": percentile(e2e, 90) * 1000,
                         "ttft_p50_ms": percentile([s.ttft for s in seq[name]], 50) * 1000,
                         "rps_c1": 1.0 / (sum(e2e) / len(e2e)), f"rps_c{c_hi}": len(par) / wall_hi}
    return out


FRONT_LABELS = {"serve": "Serve front", "uvicorn": "uvicorn front"}


def overhead_table(res: dict, args: argparse.Namespace) -> str:
    d = res["direct"]
    fronts = [f for f in ("serve", "uvicorn") if f in res]
    c_hi = args.overhead_concurrency
    lines = [f"front overhead: synthetic backend, prompt {args.prompt_len} words, {args.output_len} output tokens, "
             f"{args.requests} sequential requests per column (one per column in turn) + {args.requests * 2} "
             f"concurrent ones",
             "  serve: HTTP -> Serve proxy -> ingress replica (FastAPI + router) -> actors; "
             "uvicorn: the same app in one uvicorn process, no Serve proxy"]
    header = f"  {'':<22}{'direct actor':>13}"
    for f in fronts:
        header += f"{FRONT_LABELS[f]:>15}{'added':>10}{'ratio':>8}"
    lines.append(header)
    for key, label in (("p50_ms", "latency p50 (ms)"), ("p90_ms", "latency p90 (ms)"),
                       ("ttft_p50_ms", "TTFT p50 (ms)"), ("rps_c1", "requests/s @c=1"),
                       (f"rps_c{c_hi}", f"requests/s @c={c_hi}")):
        line = f"  {label:<22}{d[key]:>13.2f}"
        for f in fronts:
            v = res[f][key]
            line += f"{v:>15.2f}{v - d[key]:>+10.2f}{v / d[key]:>7.2f}x"
        lines.append(line)
    for f in fronts:
        lines.append(f"  added before the first token, p50: {FRONT_LABELS[f]} "
                     f"{res[f]['ttft_p50_ms'] - d['ttft_p50_ms']:+.2f} ms")
    return "\n".join(lines)


def write_overhead_results(path: str, res: dict, args: argparse.Namespace, before: dict, table: str) -> None:
    import datetime
    import os

    out = {"benchmark": "front_overhead", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "command": "raypd bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]),
           "host": {**before, "loadavg_after": list(os.getloadavg())},
           "added_ttft_p50_ms": {f: res[f]["ttft_p50_ms"] - res["direct"]["ttft_p50_ms"]
                                 for f in ("serve", "uvicorn") if f in res},
           "results": res}
    write_results(path, out, table)


def _uvicorn_front_main(config_json: str, port: int, address: str) -> None:
    """Child process of `--overhead`: the front app under plain uvicorn, attached to the same engines."""
    import uvicorn

    from serving.front import create_app, served_model_of
    from serving.config import DeploymentConfig
    from serving.cluster.ray_init import init_ray
    from serving.cluster.launcher import launch
    from serving.cluster.clients import build_router

    cfg = DeploymentConfig.from_dict(json.loads(config_json))
    init_ray(cfg, address=address)
    dep = launch(cfg)  # get-or-create: the engines are already up
    uvicorn.run(create_app(cfg, build_router(cfg, dep), served_model_of(dep)), host="127.0.0.1", port=port,
                log_level="warning")


def run_overhead(args: argparse.Namespace) -> int:
    import os
    import signal
    import subprocess

    import ray
    from ray import serve

    from serving.cluster.app import build_app
    from serving.config import DeploymentConfig, load_config
    from serving.cluster.ray_init import init_ray
    from serving.cluster.launcher import launch, shutdown_deployment

    base = load_config(args.config)
    if base.backend != "synthetic":
        print("raypd bench --overhead needs a synthetic-backend config", file=sys.stderr)
        return 2
    serve_port, uv_port = free_port(), free_port()
    data = base.model_dump(mode="json")
    data["name"] = "raypd-bench"
    data["http"].update({"host": "127.0.0.1", "port": serve_port})
    cfg = DeploymentConfig.from_dict(data)
    started = init_ray(cfg, None, temp_dir="/tmp/raypd-bench-ray")
    child = None
    try:
        print(f"starting {cfg.prefill.count}P+{cfg.decode.count}D synthetic engines, the Serve front on "
              f":{serve_port} and a uvicorn front on :{uv_port}...", flush=True)
        dep = launch(cfg)
        serve.start(http_options={"host": "127.0.0.1", "port": serve_port})
        serve.run(build_app(data), name=cfg.name, route_prefix="/", blocking=False)
        env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")  # the auth mode ray.init chose is in os.environ
        child = subprocess.Popen([sys.executable, "-m", "serving.bench.overhead", "--uvicorn-front", json.dumps(data),
                                  str(uv_port), ray.get_runtime_context().gcs_address], env=env)
        fronts = {"serve": f"http://127.0.0.1:{serve_port}", "uvicorn": f"http://127.0.0.1:{uv_port}"}
        for url in fronts.values():
            wait_healthy(url, 120, child)
        before = host_state()
        res = asyncio.run(measure_overhead(args, dep, fronts, cfg.served_model_name))
        table = overhead_table(res, args)
        print("\n" + table, flush=True)
        if args.results:
            write_overhead_results(args.results, res, args, before, table)
        return 0
    finally:
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
        try:
            serve.shutdown()
        except Exception:  # noqa: BLE001
            pass
        shutdown_deployment(cfg.name)
        if started:
            ray.shutdown()




if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--uvicorn-front":
        _uvicorn_front_main(sys.argv[2], int(sys.argv[3]), sys.argv[4])
