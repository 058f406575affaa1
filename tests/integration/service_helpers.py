"""Shared by the service tests: a small synthetic deployment, a free port, an in-thread uvicorn."""

from __future__ import annotations

import socket
import threading
import time

import ray

SYNTHETIC = {
    "backend": "synthetic",
    "synthetic": {"model_id": "synthetic-tiny", "num_layers": 2, "num_kv_heads": 2, "head_size": 32},
    "max_model_len": 4096,
    # heterogeneous TP: prefill TP=1 (block 16) -> decode TP=2 (block 32)
    "prefill": {"count": 1, "tp_size": 1, "block_size": 16, "num_blocks": 512, "num_cpus": 0},
    "decode": {"count": 1, "tp_size": 2, "block_size": 32, "num_blocks": 512, "num_cpus": 0},
    "transfer": {"failure_policy": "fail", "lease_ttl_s": 10, "read_timeout_s": 5},
    "router": {"placement": "disaggregate"},  # these tests check the prefill -> NIXL -> decode path
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_stats(deployment, timeout_s: float = 60.0) -> dict[str, dict]:
    """Every engine's stats; an engine that does not answer within `timeout_s` fails the test (GetTimeoutError)
    instead of hanging it."""
    return dict(zip(deployment.engines, ray.get([h.stats.remote() for h in deployment.engines.values()],
                                                timeout=timeout_s)))


def wait_blocks_at_baseline(deployment, baseline: dict[str, dict], timeout_s: float = 10.0) -> dict[str, dict]:
    """Free blocks and leases return to baseline (prefill leases are released asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = engine_stats(deployment)
        if all(now[e].free_blocks == baseline[e].free_blocks and now[e].held_leases == 0 for e in now):
            return now
        if time.monotonic() > deadline:
            return now
        time.sleep(0.05)


class UvicornThread:
    """The FastAPI app on a real socket, in a background thread of the test process."""

    def __init__(self, app, port: int):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "UvicornThread":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def default_app_config(name: str, path: str = "configs/local.yaml") -> dict:
    """The embedded default's deployment as written, renamed, with no CPUs reserved (the session
    cluster's CPUs are shared by the test modules)."""
    from serving.config import load_config

    base = load_config(path).model_dump(mode="json", exclude_unset=True)
    base["name"] = name
    base["both"]["num_cpus"] = 0
    return base


def run_serve_app(app, name: str, url: str, timeout_s: float = 900.0) -> float:
    """`serve.run` the app (non-blocking) and wait until its /health answers 200; seconds it took."""
    import httpx
    from ray import serve

    t0 = time.monotonic()
    serve.run(app, name=name, route_prefix="/", blocking=False)
    while True:
        try:
            if httpx.get(url + "/health", timeout=10).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        assert time.monotonic() - t0 < timeout_s, "the Serve app did not come up"
        time.sleep(2)
