"""`serving.cluster.app:build_app` deployed with Ray Serve on the session cluster: two replicas share the engines."""

from __future__ import annotations

import json

import httpx
import pytest
import ray

from serving.cluster.app import INGRESS_NAME, build_app
from serving.cluster.engines import find_engines
from serving.cluster.launcher import shutdown_deployment

from service_helpers import SYNTHETIC, free_port

NAME = "svc-serve"


@pytest.mark.slow
def test_build_app_deploys_on_the_local_cluster_and_answers(coordinator):
    from ray import serve

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        app = build_app({**SYNTHETIC, "name": NAME, "http": {"num_replicas": 2}})
        serve.run(app, name=NAME, route_prefix="/", blocking=False)
        handle = serve.get_deployment_handle(INGRESS_NAME, app_name=NAME)
        status = handle.status.remote().result(timeout_s=120)
        assert status.readiness.ready
        # both replicas attached to the same two engines (named, get-or-create, idempotent start)
        assert sorted(find_engines(NAME)) == [f"raypd-{NAME}-decode-0", f"raypd-{NAME}-prefill-0"]
        engines = ray.get(coordinator.engines.remote())
        assert sorted(e.engine_id for e in engines if e.engine_id.startswith(NAME)) == [
            f"{NAME}-decode-0", f"{NAME}-prefill-0"]

        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/health", timeout=30).status_code == 200
        for _ in range(4):  # requests land on either replica
            r = httpx.post(url + "/v1/chat/completions", timeout=30, json={
                "model": "synthetic-tiny", "max_tokens": 4,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]})
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 4
        text = ""
        with httpx.stream("POST", url + "/v1/completions", timeout=30, json={
                "model": "synthetic-tiny", "prompt": "Paris is", "max_tokens": 5, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        assert text.count(" w") == 5
        bad = httpx.post(url + "/v1/completions", content=b"{nope", timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    finally:
        serve.shutdown()
        shutdown_deployment(NAME, keep_coordinator=True)
    assert find_engines(NAME) == {}
