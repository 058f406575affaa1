"""The real front over real HTTP with synthetic engines: openai client (stream and not), errors, aborts, no leaks."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
import ray

from serving.front import create_app
from serving.config import DeploymentConfig
from serving.cluster.launcher import launch, shutdown_deployment
from serving.cluster.clients import build_router

from engine_calls import collect, request
from service_helpers import SYNTHETIC, UvicornThread, engine_stats, free_port, wait_blocks_at_baseline

NAME = "svc-test"
KEY = "sk-test-key"
MODEL = "synthetic-tiny"


@pytest.fixture(scope="module")
def service(coordinator, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api_keys"
    keys.write_text(f"# the test's key\n{KEY}\n")
    # 5 ms per token: a 3500-token answer is still streaming when the disconnect test's client leaves (by
    # the token inbox an instant engine finished it before the front saw the disconnect: nothing to abort)
    synthetic = {**SYNTHETIC["synthetic"], "token_latency_s": 0.005}
    cfg = DeploymentConfig.from_dict({**SYNTHETIC, "synthetic": synthetic, "name": NAME,
                                      "http": {"api_keys_file": str(keys)}})
    dep = launch(cfg)
    baseline = engine_stats(dep)
    router = build_router(cfg, dep)
    port = free_port()
    with UvicornThread(create_app(cfg, router), port):
        yield {"url": f"http://127.0.0.1:{port}", "dep": dep, "baseline": baseline, "router": router, "cfg": cfg}
    after = wait_blocks_at_baseline(dep, baseline)
    shutdown_deployment(NAME, keep_coordinator=True)
    for eid, stats in after.items():  # nothing leaked by any test of this module
        assert stats.free_blocks == baseline[eid].free_blocks, (eid, stats)
        assert stats.held_leases == 0, (eid, stats)


@pytest.fixture
def client(service):
    return openai.OpenAI(base_url=service["url"] + "/v1", api_key=KEY, max_retries=0, timeout=30)


def auth():
    return {"Authorization": f"Bearer {KEY}"}


def decode_local_answer(service, prompt: str, max_tokens: int) -> str:
    """The colocated reference: the decode engine prefills itself (no transfer)."""
    (decode,) = service["dep"].decodes.values()

    async def go():
        chunks = await collect(decode, request(f"ref-{time.monotonic_ns()}", prompt, max_tokens=max_tokens))
        return "".join(c.text for c in chunks)

    return asyncio.run(go())


def test_completions_with_the_openai_client_go_through_prefill_and_decode(service, client):
    prompt = "What is the capital of France? " * 4
    before = engine_stats(service["dep"])
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8)
    assert out.object == "text_completion" and out.model == MODEL
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8 and out.usage.prompt_tokens == len(prompt.encode())
    assert out.choices[0].text == decode_local_answer(service, prompt, 8)  # P/D == colocated
    after = engine_stats(service["dep"])
    (pid,) = service["dep"].prefills
    assert after[pid].requests == before[pid].requests + 1  # the prefill engine did the prompt

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == out.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 8


def test_chat_with_the_openai_client_stream_and_not(service, client):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "What is the capital of France?"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0.0,
                                         seed=1, stop=["never-there"])
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content and out.usage.total_tokens == out.usage.prompt_tokens + 6
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, stream=True)
    deltas = [c.choices[0].delta for c in stream]
    assert deltas[0].role == "assistant"
    assert "".join(d.content or "" for d in deltas) == out.choices[0].message.content


def test_models_health_and_metrics(service, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = httpx.get(service["url"] + "/health")
    assert r.status_code == 200 and r.json()["ready"]
    assert r.json()["pd_paths"] == {f"{NAME}-decode-0": [f"{NAME}-prefill-0"]}
    text = httpx.get(service["url"] + "/metrics").text
    assert 'raypd_requests_total{endpoint="completions",status="200"}' in text
    assert f'raypd_engine_free_blocks{{engine="{NAME}-decode-0",role="decode"}}' in text
    assert f'raypd_breaker_state{{decode="{NAME}-decode-0",prefill="{NAME}-prefill-0"}} 0.0' in text


@pytest.mark.parametrize("body, headers, status, code", [
    (b'{"model": "synthetic-tiny", "prompt": ', auth(), 400, "invalid_json"),
    (b'{"model": "synthetic-tiny", "prompt": "\xc3\x28"}', auth(), 400, "invalid_encoding"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "many"}, auth(), 400, "invalid_type"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": -3}, auth(), 400, "invalid_value"),
    ({"model": "gpt-4o", "prompt": "hi"}, auth(), 404, "model_not_found"),
    ({"model": MODEL, "prompt": "hi", "n": 3}, auth(), 400, "unsupported_parameter"),
    ({"model": MODEL, "prompt": "hi"}, {}, 401, "invalid_api_key"),
    ({"model": MODEL, "prompt": "hi"}, {"Authorization": "Bearer nope"}, 401, "invalid_api_key"),
    # the front refuses it as vLLM does (a prompt longer than the context): a 400, not a 5xx
    ({"model": MODEL, "prompt": "x" * 5000, "max_tokens": 200}, auth(), 400, "invalid_value"),
])
def test_errors_over_http(service, body, headers, status, code):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(service["url"] + "/v1/completions", content=content, headers=headers, timeout=30)
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    assert httpx.get(service["url"] + "/health").status_code == 200  # still serving


def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=MODEL, prompt="y" * 5000, max_tokens=2)


def test_client_disconnect_mid_stream_aborts_on_the_engines(service):
    (did,) = service["dep"].decodes
    before = engine_stats(service["dep"])[did].aborted
    body = {"model": MODEL, "prompt": "count slowly " * 4, "max_tokens": 3500, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", service["url"] + "/v1/completions", json=body, headers=auth()) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: {") for line in got)
            assert engine_stats(service["dep"])[did].running == 1  # mid-stream: there is something to abort
        # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 10
    while engine_stats(service["dep"])[did].aborted == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine_stats(service["dep"])[did].aborted > before
    assert service["router"].pool.counters["aborted"] >= 1
    now = wait_blocks_at_baseline(service["dep"], service["baseline"])
    assert all(now[e].free_blocks == service["baseline"][e].free_blocks for e in now)


def test_concurrent_streams_all_complete(service):
    async def one(http, i):
        body = {"model": MODEL, "prompt": f"request number {i} " * 3, "max_tokens": 5, "stream": True}
        text, done = "", False
        async with http.stream("POST", service["url"] + "/v1/completions", json=body, headers=auth()) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return done, text

    async def go():
        async with httpx.AsyncClient(timeout=60) as http:
            return await asyncio.gather(*(one(http, i) for i in range(24)))

    router = service["router"]
    before = (sum(router.pool.fallbacks.values()), sum(router.pool.transfer_failures.values()))
    results = asyncio.run(go())
    assert all(done and text.count(" w") == 5 for done, text in results)
    snap = router.snapshot()
    assert all(load.requests == 0 for load in snap.decode_load.values())
    # every one of them went prefill -> KV transfer -> decode (no failure hidden by the fallback)
    assert (sum(router.pool.fallbacks.values()), sum(router.pool.transfer_failures.values())) == before


def test_status_collection_without_serve(service):
    from serving.cli.status import collect_status

    status = collect_status(NAME)
    assert set(status["engines"]) == {f"{NAME}-prefill-0", f"{NAME}-decode-0"}
    assert all(e["healthy"] and e["registered"] for e in status["engines"].values())
    assert status["engines"][f"{NAME}-decode-0"]["summary"]["tp_size"] == 2
    assert status["control_plane"]["route_calls"] > 0  # the coordinator's own counters, as routers polled it
