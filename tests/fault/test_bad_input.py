"""Bad input, through the HTTP front and the actor APIs: a clear, typed error each time,
the service healthy afterwards, and nothing stranded at the end."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
import ray

from actors.protocol.request import EngineRequestError
from serving.front import create_app
from serving.config import DeploymentConfig
from serving.cluster.launcher import launch, shutdown_deployment
from serving.cluster.clients import build_router

from engine_calls import collect, request
from service_helpers import SYNTHETIC, UvicornThread, engine_stats, free_port, wait_blocks_at_baseline

NAME = "bad-input"
KEY = "sk-bad-input"
MODEL = "synthetic-tiny"
AUTH = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def service(coordinator, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api_keys"
    keys.write_text(f"{KEY}\n")
    cfg = DeploymentConfig.from_dict({**SYNTHETIC, "name": NAME,
                                      "http": {"api_keys_file": str(keys), "max_body_bytes": 64 * 1024}})
    dep = launch(cfg)
    baseline = engine_stats(dep)
    port = free_port()
    with UvicornThread(create_app(cfg, build_router(cfg, dep)), port):
        yield {"url": f"http://127.0.0.1:{port}", "dep": dep}
    after = wait_blocks_at_baseline(dep, baseline)
    shutdown_deployment(NAME, keep_coordinator=True)
    for eid, stats in after.items():
        assert stats.free_blocks == baseline[eid].free_blocks, (eid, stats)
        assert stats.held_leases == 0, (eid, stats)


def completion(**kw):
    return {"model": MODEL, "prompt": "hello", "max_tokens": 4, **kw}


def chat(**kw):
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}


# (case, path, body, headers, the one expected answer: status, error code, param)
HTTP_CASES = [
    ("malformed json", "completions", b'{"model": "synthetic-tiny", "prompt": ', AUTH, (400, "invalid_json", None)),
    ("invalid utf-8", "completions", b'{"model": "synthetic-tiny", "prompt": "\xff\xfe"}', AUTH,
     (400, "invalid_encoding", None)),
    ("body is a list", "completions", b"[1, 2, 3]", AUTH, (400, "invalid_json", None)),
    ("max_tokens wrong type", "completions", completion(max_tokens="many"), AUTH, (400, "invalid_type", "max_tokens")),
    ("max_tokens negative", "completions", completion(max_tokens=-1), AUTH, (400, "invalid_value", "max_tokens")),
    ("max_tokens huge", "completions", completion(max_tokens=10**9), AUTH, (400, "invalid_value", "max_tokens")),
    ("prompt longer than the context", "completions", completion(prompt="z" * 5000), AUTH,
     (400, "invalid_value", "input_tokens")),
    ("prompt wrong type", "completions", completion(prompt={"a": 1}), AUTH, (400, "invalid_type", "prompt")),
    ("empty prompt", "completions", completion(prompt=""), AUTH, (400, "invalid_value", "prompt")),
    ("unknown model", "completions", completion(model="not-a-model"), AUTH, (404, "model_not_found", "model")),
    ("missing api key", "completions", completion(), {"Content-Type": "application/json"},
     (401, "invalid_api_key", None)),
    ("wrong api key", "completions", completion(), {"Authorization": "Bearer sk-wrong"}, (401, "invalid_api_key", None)),
    ("n > 1", "completions", completion(n=2), AUTH, (400, "unsupported_parameter", "n")),
    ("temperature negative", "completions", completion(temperature=-1), AUTH, (400, "invalid_value", "temperature")),
    ("top_p out of range", "completions", completion(top_p=7), AUTH, (400, "invalid_value", "top_p")),
    ("stop wrong type", "completions", completion(stop=5), AUTH, (400, "invalid_type", "stop")),
    ("oversized body", "completions", completion(prompt="q" * (100 * 1024)), AUTH, (413, "request_too_large", None)),
    ("chat messages not a list", "chat/completions", chat(messages="hi"), AUTH, (400, "invalid_type", "messages")),
    # (no messages and custom roles are accepted, as by vLLM: the chat template decides)
    ("chat max_tokens negative", "chat/completions", chat(max_tokens=-5), AUTH, (400, "invalid_value", "max_tokens")),
]


@pytest.mark.parametrize("name, path, body, headers, expected", HTTP_CASES, ids=[c[0] for c in HTTP_CASES])
def test_http_bad_input_gets_its_own_4xx_and_code(service, name, path, body, headers, expected):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(f"{service['url']}/v1/{path}", content=content, headers=headers, timeout=30)
    err = r.json()["error"]
    assert (r.status_code, err["code"], err["param"]) == expected, r.text
    assert err["message"] and err["type"] == "invalid_request_error", err
    assert httpx.get(service["url"] + "/health").status_code == 200


def test_client_supplied_transfer_params_never_reach_an_engine(service):
    """Only the router sets kv_transfer_params: a client's are refused before any engine sees them."""
    forged = {"remote_engine_id": "x", "remote_block_ids": [999999], "num_tokens": 5, "tp_size": 1,
              "block_size": 16}
    r = httpx.post(f"{service['url']}/v1/completions", headers=AUTH, timeout=30,
                   content=json.dumps(completion(kv_transfer_params=forged)).encode())
    assert (r.status_code, r.json()["error"]["param"]) == (400, "kv_transfer_params"), r.text


# (case, the forged fields, what happens: "refused" by the decode engine's validation before anything
# moves, a 400 for a client; "failed": valid in form, the pull fails and the `fail` policy ends the
# request with an error chunk and no token)
FORGED = [
    ("unknown engine id", {"remote_engine_id": "no-such-engine"}, "failed"),
    ("too few block ids for the tokens", {"remote_block_ids": [10**6] * 3}, "refused"),
    ("out-of-range block ids", {"remote_block_ids": [10**6] * 8}, "failed"),
    ("negative token count", {"num_tokens": -4}, "refused"),
    ("wrong tp size", {"tp_size": 3}, "failed"),
    ("dcp without tp", {"dcp_size": 2}, "refused"),
    ("block ids of the wrong type", {"remote_block_ids": "1,2,3"}, "refused"),
]


@pytest.mark.parametrize("name, change, outcome", FORGED, ids=[c[0] for c in FORGED])
def test_forged_transfer_params_at_the_actor_api_never_produce_an_answer(service, name, change, outcome):
    dep = service["dep"]
    (prefill,) = dep.prefills.values()
    (decode,) = dep.decodes.values()
    prompt = "what is in the cache? " * 3

    async def go():
        req = request(f"forge-{name}", prompt, max_tokens=4)
        pre = await prefill.prefill.remote(req)
        forged = pre.continuation(req).replace(request_id=f"forge-{name}-d",
                                               kv_transfer_params={**pre.kv_transfer_params, **change})
        try:
            if outcome == "refused":
                with pytest.raises(ray.exceptions.RayTaskError, match="invalid kv_transfer_params") as err:
                    await collect(decode, forged)
                assert isinstance(err.value.cause, EngineRequestError)  # a 400 at the front, never a 5xx
            else:
                chunks = await collect(decode, forged)
                assert chunks[-1].finish_reason == "error" and chunks[-1].error, chunks[-1]
                assert not any(c.token_ids for c in chunks)  # never tokens from KV it could not verify
        finally:
            await prefill.abort.remote(f"forge-{name}")

    asyncio.run(go())
    assert httpx.get(service["url"] + "/health").status_code == 200


def test_foreign_block_ids_are_caught_by_verification(service):
    """Ids in range but holding another request's KV: the synthetic decode's checks refuse them."""
    dep = service["dep"]
    (prefill,) = dep.prefills.values()
    (decode,) = dep.decodes.values()

    async def go():
        own = request("own", "A" * 64, max_tokens=4)
        a = await prefill.prefill.remote(own)
        b = await prefill.prefill.remote(request("foreign", "B" * 64, max_tokens=4))
        params = {**a.kv_transfer_params, "remote_block_ids": b.kv_transfer_params["remote_block_ids"]}
        chunks = await collect(decode, a.continuation(own).replace(request_id="own-d", kv_transfer_params=params))
        assert chunks[-1].finish_reason == "error" and "verification" in chunks[-1].error
        for rid in ("own", "foreign"):
            await prefill.abort.remote(rid)

    asyncio.run(go())
