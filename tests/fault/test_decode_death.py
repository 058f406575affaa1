"""The only decode engine is killed (-9, its whole process tree) mid-stream.

With restarts (the default) the stream waits for the restarted engine and continues there from
the tokens already streamed: the client gets the uninterrupted answer, no error. Without restarts
the stream ends with an SSE error event after what was streamed. Either way the prefill engine
holds nothing afterwards.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import ray

from serving.front import create_app
from serving.config import DeploymentConfig
from serving.cluster.launcher import launch, shutdown_deployment
from serving.cluster.clients import build_router

from chaos_helpers import kill_tree
from service_helpers import SYNTHETIC, UvicornThread, engine_stats, free_port

pytestmark = [pytest.mark.slow, pytest.mark.injects_faults]

MODEL = "synthetic-tiny"
PROMPT = "stream me a long answer " * 4
MAX_TOKENS = 120


def stream(url: str, kill_after: int, kill) -> tuple[list[str], str, str | None]:
    """(events, text, error) of one streamed completion; `kill()` runs after `kill_after` events."""
    events, text, error = [], "", None
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            events.append(line[6:])
            if "error" in event:
                error = event["error"]["message"]
            else:
                text += event["choices"][0]["text"]
            if len(events) == kill_after and kill is not None:
                kill()
    return events, text, error


def run(name: str, restarts: int, migration_wait_s: float) -> dict:
    cfg = DeploymentConfig.from_dict({
        **SYNTHETIC, "name": name,
        "synthetic": {**SYNTHETIC["synthetic"], "token_latency_s": 0.03},
        "restarts": {"max_restarts": restarts}, "router": {"migration_wait_s": migration_wait_s, "placement": "disaggregate"},
    })
    dep = launch(cfg)
    baseline = engine_stats(dep)
    (prefill_id,) = dep.prefills
    (decode,) = dep.decodes.values()
    port = free_port()
    out: dict = {}
    try:
        router = build_router(cfg, dep)
        with UvicornThread(create_app(cfg, router), port):
            url = f"http://127.0.0.1:{port}"
            _, out["reference"], _ = stream(url, 0, None)
            tree = ray.get(decode.stats.remote())
            pids = [tree.pid, *tree.backend.child_pids]
            out["events"], out["text"], out["error"] = stream(url, 5, lambda: threading.Thread(
                target=kill_tree, args=(pids,)).start())
            out["migrations"] = dict(router.pool.migrations)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:  # the prefill engine holds nothing for the request
                p = ray.get(dep.prefills[prefill_id].stats.remote())
                if p.free_blocks == baseline[prefill_id].free_blocks and p.held_leases == 0:
                    break
                time.sleep(0.1)
            out["prefill"] = p
    finally:
        shutdown_deployment(name, keep_coordinator=True)
    out["baseline"] = baseline[prefill_id]
    return out


def test_stream_continues_on_the_restarted_decode_engine(coordinator):
    out = run("decode-death", 3, 30.0)
    assert out["error"] is None, out["error"]
    assert out["text"] == out["reference"]  # token for token the uninterrupted stream
    assert out["migrations"] == {"engine_died": 1}
    assert out["prefill"].free_blocks == out["baseline"].free_blocks and out["prefill"].held_leases == 0


def test_without_restarts_the_stream_ends_with_an_error_event(coordinator):
    out = run("decode-death-final", 0, 2.0)
    assert out["error"] is not None and "no engine could take the stream over" in out["error"]
    assert out["text"] and out["reference"].startswith(out["text"])  # what was streamed stands, cut cleanly
    assert out["prefill"].free_blocks == out["baseline"].free_blocks and out["prefill"].held_leases == 0
