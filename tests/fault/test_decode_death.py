"""Kill the decode engine mid-stream: the client gets an error event, the prefill side holds nothing."""

from __future__ import annotations

import json
import time

import httpx
import ray

from serving.front import create_app
from serving.config import DeploymentConfig
from serving.launcher import launch, shutdown_deployment
from serving.ray_clients import build_router

from service_helpers import SYNTHETIC, UvicornThread, engine_stats, free_port

NAME = "decode-death"
MODEL = "synthetic-tiny"


def test_decode_engine_killed_mid_stream(coordinator):
    cfg = DeploymentConfig.from_dict({
        **SYNTHETIC, "name": NAME,
        "synthetic": {**SYNTHETIC["synthetic"], "token_latency_s": 0.05},
        "router": {"no_prefill_fallback": "decode_local"},
    })
    dep = launch(cfg)
    baseline = engine_stats(dep)
    (prefill_id,) = dep.prefills
    (decode,) = dep.decodes.values()
    port = free_port()
    events, text = [], ""
    try:
        with UvicornThread(create_app(cfg, build_router(cfg, dep)), port):
            body = {"model": MODEL, "prompt": "stream me a long answer " * 4, "max_tokens": 200, "stream": True}
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(line[6:])
                    if line[6:] != "[DONE]" and "error" not in line:
                        text += json.loads(line[6:])["choices"][0]["text"]
                    if len(events) == 5:
                        ray.kill(decode)  # mid-stream
            assert len(events) < 200, "the stream must end early"
            errors = [e for e in events if e != "[DONE]" and "error" in json.loads(e)]
            assert errors, events[-3:]  # the client is told, never left hanging or given a silent cut
            assert text  # tokens before the failure were delivered
            # the prefill engine holds nothing for the dead request
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                p = ray.get(dep.prefills[prefill_id].stats.remote())
                if p["free_blocks"] == baseline[prefill_id]["free_blocks"] and p["held_leases"] == 0:
                    break
                time.sleep(0.1)
            assert p["free_blocks"] == baseline[prefill_id]["free_blocks"] and p["held_leases"] == 0, p
            health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
            assert health.status_code in (200, 503)  # answers either way, never hangs
    finally:
        shutdown_deployment(NAME, keep_coordinator=True)
