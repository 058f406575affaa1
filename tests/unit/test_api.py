"""The HTTP front with a fake router: OpenAI shapes, SSE, validation and error bodies (no Ray)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from actors.protocol import TokenChunk
from serving.api import create_app
from serving.config import DeploymentConfig
from serving.router import RouteError

MODEL = "synthetic-tiny"


class FakeStream:
    def __init__(self, chunks):
        self.chunks = list(chunks)
        self.num_prompt_tokens = 7
        self.num_generated = 0
        self.closed = False
        self.finished = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.chunks:
            raise StopAsyncIteration
        c = self.chunks.pop(0)
        c = TokenChunk("r", **{k: tuple(v) if k == "token_ids" else v for k, v in c.items()})
        self.num_generated += len(c.token_ids)
        self.finished = c.finished
        return c

    def close(self):
        self.closed = True


def tokens(n=3, finish="length"):
    return [{"token_ids": [i], "text": f" w{i}", "finished": i == n - 1,
             "finish_reason": finish if i == n - 1 else None, "num_prompt_tokens": 7} for i in range(n)]


class FakeRouter:
    def __init__(self):
        self.requests = []
        self.streams = []
        self.chunks = tokens()
        self.error = None
        self.healthy = True
        self.engine_stats = {}

    async def open(self, req):
        self.requests.append(req)
        if self.error is not None:
            raise self.error
        s = FakeStream(self.chunks)
        self.streams.append(s)
        return s

    async def health(self):
        return {"healthy": self.healthy, "reason": None if self.healthy else "no decode engine is alive"}

    async def refresh_engine_stats(self):
        self.engine_stats = {"d0": {"up": True, "role": "decode", "free_blocks": 5, "held_leases": 0}}
        return self.engine_stats

    def snapshot(self):
        return {"prefill_load": {"p0": {"requests": 0, "tokens": 0}},
                "decode_load": {"d0": {"requests": 1, "tokens": 4}},
                "breakers": {"p0->d0": {"state": "open", "opened_count": 1}},
                "transfer_failures": {"p0->d0": 2}, "prefill_failures": {}, "fallbacks": {"no_prefill_engine": 3},
                "counters": {"prefill_retries": 1}}


def make_client(**http):
    cfg = DeploymentConfig.from_dict({"backend": "synthetic", "max_model_len": 256, "http": http})
    router = FakeRouter()
    return TestClient(create_app(cfg, router)), router


@pytest.fixture
def client():
    c, router = make_client()
    c.router = router
    return c


def post(client, path, body, **kw):
    return client.post(path, content=json.dumps(body) if not isinstance(body, (bytes, str)) else body, **kw)


def sse_events(text):
    events = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


# ------------------------------------------------------------------ happy paths
def test_completion_non_stream(client):
    r = post(client, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3, "stop": "x", "seed": 4})
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL and body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == " w0 w1 w2" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    sent = client.router.requests[0]
    assert sent.prompt == "hi" and sent.sampling.stop == ("x",) and sent.sampling.seed == 4 and sent.max_tokens == 3
    assert client.router.streams[0].closed


def test_completion_token_prompt_and_single_batch(client):
    post(client, "/v1/completions", {"model": MODEL, "prompt": [1, 2, 3]})
    post(client, "/v1/completions", {"model": MODEL, "prompt": ["only one"]})
    assert client.router.requests[0].prompt_token_ids == (1, 2, 3)
    assert client.router.requests[0].max_tokens == 16  # the OpenAI default for completions
    assert client.router.requests[1].prompt == "only one"


def test_completion_stream(client):
    r = post(client, "/v1/completions", {"model": MODEL, "prompt": "hi", "stream": True,
                                         "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == " w0 w1 w2"
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
    assert all(e["object"] == "text_completion" for e in events)


def test_chat_non_stream_and_stream(client):
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "up?"}]}]
    r = post(client, "/v1/chat/completions", {"model": MODEL, "messages": msgs})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": " w0 w1 w2"}
    sent = client.router.requests[0]
    assert sent.messages[1] == {"role": "user", "content": "What is up?"}
    assert sent.max_tokens == 256  # default_max_tokens capped at the context length
    r = post(client, "/v1/chat/completions", {"model": MODEL, "messages": msgs, "stream": True,
                                              "max_completion_tokens": 5})
    events = sse_events(r.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == " w0 w1 w2"
    assert events[-1]["choices"][0]["finish_reason"] == "length" and events[-1]["choices"][0]["delta"] == {}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert client.router.requests[1].max_tokens == 5


def test_models_health_metrics(client):
    r = client.get("/v1/models")
    assert r.json()["data"][0]["id"] == MODEL and r.json()["object"] == "list"
    assert client.get("/health").status_code == 200
    client.router.healthy = False
    r = client.get("/health")
    assert r.status_code == 503 and r.json()["reason"] == "no decode engine is alive"
    post(client, "/v1/completions", {"model": MODEL, "prompt": "hi"})
    post(client, "/v1/completions", {"model": "nope", "prompt": "hi"})
    text = client.get("/metrics").text
    for needle in ('raypd_requests_total{endpoint="completions",status="200"} 1.0',
                   'raypd_requests_total{endpoint="completions",status="404"} 1.0',
                   "raypd_time_to_first_token_seconds_bucket", "raypd_inter_token_latency_seconds_bucket",
                   "raypd_e2e_request_latency_seconds_bucket",
                   'raypd_breaker_state{decode="d0",prefill="p0"} 2.0',
                   'raypd_kv_transfer_failures_total{decode="d0",prefill="p0"} 2.0',
                   'raypd_fallbacks_total{reason="no_prefill_engine"} 3.0',
                   'raypd_decode_queue_depth{engine="d0"} 1.0', 'raypd_prefill_queue_depth{engine="p0"} 0.0',
                   'raypd_engine_free_blocks{engine="d0",role="decode"} 5.0',
                   'raypd_leases_held{engine="d0",role="decode"} 0.0'):
        assert needle in text, needle


# ------------------------------------------------------------------ errors
def assert_error(r, status, param=None, code=None, contains=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    if contains is not None:
        assert contains in err["message"]
    return err


BAD = [
    (b'{"model": "synthetic-tiny", "prompt": ', 400, None, "invalid_json"),
    (b'[1, 2]', 400, None, "invalid_json"),
    (b'{"model": "synthetic-tiny", "prompt": "\xff\xfe"}', 400, None, "invalid_encoding"),
    (b'{"model": "synthetic-tiny", "prompt": "hi", "temperature": NaN}', 400, None, "invalid_json"),
    ({"prompt": "hi"}, 422, "model", "invalid_type"),
    ({"model": MODEL}, 422, "prompt", "invalid_type"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, 422, "max_tokens", "invalid_type"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2.5}, 422, "max_tokens", "invalid_type"),
    ({"model": MODEL, "prompt": 12}, 422, "prompt", "invalid_type"),
    ({"model": MODEL, "prompt": "hi", "stream": "yes"}, 422, "stream", "invalid_type"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": -1}, 400, "max_tokens", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 10**12}, 400, "max_tokens", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "temperature": 3}, 400, "temperature", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "stop": ["s"] * 17}, 400, "stop", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "seed": 2**70}, 400, "seed", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "n": 2}, 400, "n", "unsupported_parameter"),
    ({"model": MODEL, "prompt": "hi", "logprobs": 2}, 400, "logprobs", "unsupported_parameter"),
    ({"model": MODEL, "prompt": "hi", "presence_penalty": 0.5}, 400, "presence_penalty", "unsupported_parameter"),
    ({"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt", "unsupported_parameter"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt", "invalid_value"),
    ({"model": MODEL, "prompt": [-1]}, 400, "prompt", "invalid_value"),
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model", "model_not_found"),
]


@pytest.mark.parametrize("body, status, param, code", BAD)
def test_completion_errors(client, body, status, param, code):
    assert_error(post(client, "/v1/completions", body), status, param, code)
    assert client.router.requests == []  # nothing reached the router


CHAT_BAD = [
    ({"model": MODEL, "messages": "hi"}, 422, "messages", None),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 422, "messages.0.role", None),
    ({"model": MODEL, "messages": []}, 400, "messages", None),
    ({"model": MODEL, "messages": [{"role": "user", "content": ""}]}, 400, "messages", None),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages.0.content", "unsupported_parameter"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
     400, "tools", "unsupported_parameter"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 100000},
     400, "max_completion_tokens", "invalid_value"),
]


@pytest.mark.parametrize("body, status, param, code", CHAT_BAD)
def test_chat_errors(client, body, status, param, code):
    assert_error(post(client, "/v1/chat/completions", body), status, param, code)


def test_neutral_values_of_unsupported_parameters_are_accepted(client):
    r = post(client, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                              "n": 1, "logprobs": False, "presence_penalty": 0,
                                              "frequency_penalty": 0.0, "some_vendor_field": 1})
    assert r.status_code == 200


def test_api_keys(monkeypatch):
    monkeypatch.setenv("RAYPD_API_KEYS", "sk-good")  # read when the app is built, never from the config
    c, router = make_client()
    body = {"model": MODEL, "prompt": "hi"}
    assert_error(post(c, "/v1/completions", body), 401, code="invalid_api_key", contains="Missing")
    assert_error(post(c, "/v1/completions", body, headers={"Authorization": "Bearer sk-bad"}), 401,
                 code="invalid_api_key", contains="Incorrect")
    assert_error(post(c, "/v1/completions", body, headers={"Authorization": "Basic sk-good"}), 401)
    assert_error(c.get("/v1/models"), 401)
    assert post(c, "/v1/completions", body, headers={"Authorization": "Bearer sk-good"}).status_code == 200
    assert c.get("/v1/models", headers={"Authorization": "Bearer sk-good"}).status_code == 200
    assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200  # probes: no key


def test_oversized_body_is_413():
    c, router = make_client(max_body_bytes=1024)
    big = {"model": MODEL, "prompt": "x" * 2000}
    assert_error(post(c, "/v1/completions", big), 413, code="request_too_large")

    def chunks():  # no content-length: the limit holds while reading
        yield b'{"model": "synthetic-tiny", "prompt": "'
        for _ in range(10):
            yield b"y" * 200
        yield b'"}'

    assert_error(c.post("/v1/completions", content=chunks()), 413, code="request_too_large")
    assert router.requests == []


def test_too_many_in_flight_is_429():
    c, router = make_client(max_inflight_requests=1)
    c.app.state.inflight = 1  # one request is being served
    err = assert_error(post(c, "/v1/completions", {"model": MODEL, "prompt": "hi"}), 429, code="rate_limit_exceeded")
    assert err["type"] == "rate_limit_error"
    c.app.state.inflight = 0
    assert post(c, "/v1/completions", {"model": MODEL, "prompt": "hi"}).status_code == 200
    assert c.app.state.inflight == 0


@pytest.mark.parametrize("status, code", [(503, "no_prefill_engine"), (400, "invalid_prompt")])
def test_router_errors_become_error_bodies(client, status, code):
    client.router.error = RouteError(status, "nope", type="invalid_request_error" if status == 400 else "server_error",
                                     code=code)
    for stream in (False, True):
        r = post(client, "/v1/completions", {"model": MODEL, "prompt": "hi", "stream": stream})
        err = assert_error(r, status, code=code)
        assert err["type"] == ("server_error" if status == 503 else "invalid_request_error")
    assert client.app.state.inflight == 0


def test_engine_error_mid_stream_is_an_sse_error_event_and_a_503_without_stream(client):
    client.router.chunks = tokens(2, finish="length")[:1] + [
        {"token_ids": [], "text": "", "finished": True, "finish_reason": "error", "error": "KV transfer failed: x"}]
    r = post(client, "/v1/completions", {"model": MODEL, "prompt": "hi", "stream": True})
    lines = [ln for ln in r.text.split("\n") if ln.startswith("data: ")]
    assert json.loads(lines[0][6:])["choices"][0]["text"] == " w0"
    assert json.loads(lines[-2][6:])["error"]["message"] == "KV transfer failed: x" and lines[-1] == "data: [DONE]"
    client.router.chunks = [{"token_ids": [], "text": "", "finished": True, "finish_reason": "error", "error": "boom"}]
    assert_error(post(client, "/v1/completions", {"model": MODEL, "prompt": "hi"}), 503, code="engine_error")
    assert all(s.closed for s in client.router.streams)
    assert client.app.state.inflight == 0


def test_unknown_route_and_method_have_error_bodies(client):
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get("/v1/completions"), 405)
