"""The HTTP front with a fake router: vLLM's request semantics, OpenAI shapes, SSE, errors (no Ray)."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from actors.protocol.request import ModelInfo, TokenChunk
from actors.engine.synthetic.tokenizer import chat_to_text, encode_text
from serving.config import DeploymentConfig
from serving.front import create_app
from serving.front.served_model import SyntheticServedModel
from serving.routing.route_errors import InvalidRequest, NoPrefillEngine
from serving.routing.stream import Route
from serving.routing.status import Readiness
from typed_fakes import router_snapshot

MODEL = "synthetic-tiny"


class FakeStream:
    """A `serving.routing.protocols.TokenStream`."""

    def __init__(self, chunks):
        self.chunks = list(chunks)
        self.route = Route("d0")
        self.first_stamps = ()
        self.num_prompt_tokens = 7
        self.num_generated = 0
        self.num_cached_tokens = None
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
        if c.num_cached_tokens is not None:  # as RoutedStream: the engine's first chunk says it
            self.num_cached_tokens = c.num_cached_tokens
        self.finished = c.finished
        return c

    def close(self):
        self.closed = True


def tokens(n=3, finish="length"):
    return [{"token_ids": [i], "text": f" w{i}", "finished": i == n - 1,
             "finish_reason": finish if i == n - 1 else None, "num_prompt_tokens": 7} for i in range(n)]


class FakeRouter:
    """A `serving.routing.protocols.RequestRouter`."""

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

    async def readiness(self):
        return Readiness(self.healthy, None if self.healthy else "no decode engine is alive")

    async def refresh_engine_stats(self):
        return {}

    def snapshot(self):
        return router_snapshot()


def make_client(defaults=None, **http):
    cfg = DeploymentConfig.from_dict({"backend": "synthetic", "max_model_len": 256, "http": http})
    router = FakeRouter()
    model = SyntheticServedModel(ModelInfo("synthetic", 256, 32000, default_sampling_params=defaults or {}))
    return TestClient(create_app(cfg, router, model)), router


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
    assert sent.prompt_token_ids == tuple(encode_text("hi"))  # the front tokenized: engines get ids only
    assert sent.sampling.stop == ("x",) and sent.sampling.seed == 4 and sent.max_tokens == 3
    assert client.router.streams[0].closed


def test_completion_token_prompt_and_single_batch(client):
    post(client, "/v1/completions", {"model": MODEL, "prompt": [1, 2, 3]})
    post(client, "/v1/completions", {"model": MODEL, "prompt": ["only one"]})
    assert client.router.requests[0].prompt_token_ids == (1, 2, 3)
    assert client.router.requests[0].max_tokens == 16  # vLLM's default for completions
    assert client.router.requests[1].prompt_token_ids == tuple(encode_text("only one"))


def test_sampling_follows_the_generation_config_unless_the_request_sets_it():
    c, router = make_client(defaults={"temperature": 0.25, "top_p": 0.5, "max_tokens": 9})
    post(c, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": None})
    post(c, "/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": 0.0, "top_p": 1.0, "max_tokens": 4})
    default, explicit = router.requests
    assert (default.sampling.temperature, default.sampling.top_p, default.max_tokens) == (0.25, 0.5, 16)
    assert (explicit.sampling.temperature, explicit.sampling.top_p, explicit.max_tokens) == (0.0, 1.0, 4)
    post(c, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert router.requests[-1].max_tokens == 9  # chat without max_tokens: the generation config's max


def test_only_sampled_requests_that_may_replay_get_a_seed(client):
    """A seed only where the decode engine may replay the first token (structured outputs,
    penalties without raypd's processor...): plain sampling stays unseeded, as in vLLM."""
    post(client, "/v1/completions", {"model": MODEL, "prompt": "hi"})
    post(client, "/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": 0})
    post(client, "/v1/completions", {"model": MODEL, "prompt": "hi", "frequency_penalty": 0.5})
    post(client, "/v1/completions", {"model": MODEL, "prompt": "hi", "seed": 5})
    sampled, greedy, penalised, seeded = client.router.requests
    assert sampled.sampling.temperature == 1.0 and sampled.sampling.seed is None
    assert greedy.sampling.seed is None
    assert penalised.sampling.seed is not None
    assert seeded.sampling.seed == 5


def test_completion_stream(client):
    r = post(client, "/v1/completions", {"model": MODEL, "prompt": "hi", "stream": True,
                                         "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == " w0 w1 w2"
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
    assert all(e["object"] == "text_completion" for e in events)


def test_return_token_ids(client):
    body = {"model": MODEL, "prompt": "hi", "return_token_ids": True}
    choice = post(client, "/v1/completions", body).json()["choices"][0]
    assert choice["token_ids"] == [0, 1, 2] and choice["prompt_token_ids"] == encode_text("hi")
    events = sse_events(post(client, "/v1/completions", {**body, "stream": True}).text)
    assert events[0]["choices"][0]["prompt_token_ids"] == encode_text("hi")
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == [0, 1, 2]


def test_chat_non_stream_and_stream(client):
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "up?"}]}]
    r = post(client, "/v1/chat/completions", {"model": MODEL, "messages": msgs})
    body = r.json()
    assert r.status_code == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": " w0 w1 w2"}
    sent = client.router.requests[0]
    prompt = encode_text(chat_to_text([("system", "be brief"), ("user", "What is up?")]))
    assert sent.prompt_token_ids == tuple(prompt)
    assert sent.max_tokens == 256 - len(prompt)  # vLLM: no max_tokens in chat fills the context
    r = post(client, "/v1/chat/completions", {"model": MODEL, "messages": msgs, "stream": True,
                                              "max_completion_tokens": 5})
    events = sse_events(r.text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == " w0 w1 w2"
    # as vLLM's server: the finish reason rides on the last token's delta
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["choices"][0]["delta"] == {"content": " w2"}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert client.router.requests[1].max_tokens == 5


def test_tokenize_round_trips_and_detokenize(client):
    r = post(client, "/tokenize", {"model": MODEL, "prompt": "héllo", "return_token_strs": True})
    body = r.json()
    assert r.status_code == 200 and body["tokens"] == encode_text("héllo") and body["count"] == 6
    assert body["max_model_len"] == 256
    assert post(client, "/detokenize", {"model": MODEL, "tokens": body["tokens"]}).json() == {"prompt": "héllo"}
    chat = post(client, "/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == encode_text(chat_to_text([("user", "hi")]))
    assert_error(post(client, "/detokenize", {"model": MODEL, "tokens": [10**6]}), 400, param="tokens")
    assert_error(post(client, "/tokenize", {"model": "gpt-4", "prompt": "x"}), 404, code="model_not_found")


def test_models_version_health_metrics(client):
    r = client.get("/v1/models")
    assert r.json()["data"][0]["id"] == MODEL and r.json()["object"] == "list"
    from vllm import __version__
    assert client.get("/version").json() == {"version": __version__, "raypd_version": "0.1.0"}
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
    ({"model": MODEL}, 400, "prompt", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens", "invalid_type"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens", "invalid_type"),
    ({"model": MODEL, "prompt": 12}, 400, "prompt", "invalid_type"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 10**12}, 400, "max_tokens", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "temperature": 3}, 400, "temperature", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p", "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "top_k": -5}, 400, None, "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "min_p": 2}, 400, None, "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "seed": 2**70}, 400, "seed", "invalid_type"),
    ({"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options",
     "invalid_value"),
    ({"model": MODEL, "prompt": "hi", "n": 2}, 400, "n", "unsupported_parameter"),
    ({"model": MODEL, "prompt": "hi", "logprobs": 2}, 400, "logprobs", "unsupported_parameter"),
    ({"model": MODEL, "prompt": "hi", "echo": True}, 400, "echo", "unsupported_parameter"),
    ({"model": MODEL, "prompt": "hi", "use_beam_search": True}, 400, "use_beam_search", "unsupported_parameter"),
    ({"model": MODEL, "prompt": "hi", "kv_transfer_params": {"do_remote_prefill": True}}, 400,
     "kv_transfer_params", "unsupported_parameter"),
    ({"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt", "invalid_value"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt", "invalid_value"),
    ({"model": MODEL, "prompt": [-1]}, 400, "prompt.0", "invalid_type"),
    ({"model": MODEL, "prompt": [32000]}, 400, "prompt", "invalid_value"),  # out of the vocabulary
    ({"model": MODEL, "prompt": "x" * 300}, 400, "input_tokens", "invalid_value"),  # longer than the context
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model", "model_not_found"),
]


@pytest.mark.parametrize("body, status, param, code", BAD)
def test_completion_errors(client, body, status, param, code):
    assert_error(post(client, "/v1/completions", body), status, param, code)
    assert client.router.requests == []  # nothing reached the router


CHAT_BAD = [
    ({"model": MODEL, "messages": "hi"}, 400, "messages", "invalid_type"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages", "invalid_value"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 100000},
     400, "max_completion_tokens", "invalid_value"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "logprobs": True}, 400, "logprobs",
     "unsupported_parameter"),
]


@pytest.mark.parametrize("body, status, param, code", CHAT_BAD)
def test_chat_errors(client, body, status, param, code):
    assert_error(post(client, "/v1/chat/completions", body), status, param, code)
    assert client.router.requests == []


def test_vllm_parameters_and_neutral_values_are_accepted(client):
    r = post(client, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 1, "logprobs": False,
        "presence_penalty": 0.5, "frequency_penalty": 0.1, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2,
        "stop_token_ids": [7], "min_tokens": 1, "chat_template_kwargs": {"x": 1}, "some_vendor_field": 1})
    assert r.status_code == 200, r.text


def test_api_keys(monkeypatch):
    monkeypatch.setenv("RAYPD_API_KEYS", "sk-good")  # read when the app is built, never from the config
    c, router = make_client()
    body = {"model": MODEL, "prompt": "hi"}
    assert_error(post(c, "/v1/completions", body), 401, code="invalid_api_key", contains="Missing")
    assert_error(post(c, "/v1/completions", body, headers={"Authorization": "Bearer sk-bad"}), 401,
                 code="invalid_api_key", contains="Incorrect")
    assert_error(post(c, "/v1/completions", body, headers={"Authorization": "Basic sk-good"}), 401)
    assert_error(c.get("/v1/models"), 401)
    assert_error(post(c, "/tokenize", {"prompt": "x"}), 401)
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
    accounting = c.app.state.front.accounting
    accounting.inflight = 1  # one request is being served
    err = assert_error(post(c, "/v1/completions", {"model": MODEL, "prompt": "hi"}), 429, code="rate_limit_exceeded")
    assert err["type"] == "rate_limit_error"
    accounting.inflight = 0
    assert post(c, "/v1/completions", {"model": MODEL, "prompt": "hi"}).status_code == 200
    assert accounting.inflight == 0


@pytest.mark.parametrize("error, status, code", [(NoPrefillEngine("nope"), 503, "no_prefill_engine"),
                                                 (InvalidRequest("nope"), 400, "invalid_prompt")])
def test_router_errors_become_error_bodies(client, error, status, code):
    client.router.error = error
    for stream in (False, True):
        r = post(client, "/v1/completions", {"model": MODEL, "prompt": "hi", "stream": stream})
        err = assert_error(r, status, code=code)
        assert err["type"] == ("server_error" if status == 503 else "invalid_request_error")
    assert client.app.state.front.accounting.inflight == 0


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
    assert client.app.state.front.accounting.inflight == 0


def test_unknown_route_and_method_have_error_bodies(client):
    assert_error(client.get("/v1/nothing"), 404)
    assert_error(client.get("/v1/completions"), 405)
