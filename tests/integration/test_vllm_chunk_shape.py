"""raypd's SSE chunks have the shape of vLLM's own OpenAI server, chunk for chunk.

One tiny random Llama (float32) served twice: by `python -m vllm.entrypoints.openai.api_server` and
by raypd (one role-flexible engine, its front in this process). The same greedy streamed request
goes to both, on /v1/completions and on /v1/chat/completions: the chunks carrying text, where the
finish reason rides (the last token's chunk: no empty finish chunk after it) and the usage chunk
must match (ids, timestamps and model names aside). Tools built for vLLM's stream (`vllm bench
serve`) count one token per text chunk, so a chunk more or less is a token miscounted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from actors.models.tiny_llama import build_tiny_llama
from serving.cluster.clients import build_router
from serving.cluster.launcher import launch, shutdown_deployment
from serving.config import DeploymentConfig, load_config
from serving.front import create_app, served_model_of
from serving.ops.health_probe import wait_healthy

from service_helpers import UvicornThread, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NAME = "vllm-chunk-shape"
MAX_MODEL_LEN = 512
PROMPT = "The three most important things to know about the ocean are"
MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def servers(coordinator, tmp_path_factory):
    model = build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-shape", seed=5, progress=None)
    port = free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="1")
    # prompt token details on: raypd's final usage reports the prompt's cached tokens, as vLLM with it
    vllm = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
         "--served-model-name", "m", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
         "--enforce-eager", "--port", str(port), "--host", "127.0.0.1", "--seed", "0",
         "--enable-prompt-tokens-details", "--disable-uvicorn-access-log"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = load_config("configs/local.yaml").model_dump(mode="json")
        base.update(name=NAME, model=str(model), max_model_len=MAX_MODEL_LEN)
        base["http"]["served_model_name"] = "m"
        base["both"].update(count=1, num_cpus=0)
        base["both"]["cpu"]["bind"] = ["0"]
        cfg = DeploymentConfig.from_dict(base)
        dep = launch(cfg)
        raypd_port = free_port()
        with UvicornThread(create_app(cfg, build_router(cfg, dep), served_model_of(dep)), raypd_port):
            wait_healthy(f"http://127.0.0.1:{port}", 600, vllm, interval_s=1)
            yield {"vllm": f"http://127.0.0.1:{port}", "raypd": f"http://127.0.0.1:{raypd_port}"}
        shutdown_deployment(NAME, keep_coordinator=True)
    finally:
        vllm.terminate()
        try:
            vllm.wait(30)
        except subprocess.TimeoutExpired:
            vllm.kill()


def stream(url: str, path: str, body: dict) -> list[dict]:
    """The `data:` events of one streamed answer, `[DONE]` last."""
    events = []
    with httpx.stream("POST", url + path, json={"model": "m", "stream": True, **body}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def shape(events: list[dict]) -> list[tuple]:
    """Per event: (delta or text, finish_reason, usage) for a choice chunk; ("usage", counts, prompt
    token details) for the usage chunk. Ids, timestamps, model names and fields vLLM fills with nulls are left out."""
    out = []
    for e in events:
        if not e["choices"]:
            usage = dict(e["usage"])
            # vLLM's chat also counts the prompt tokens its own cache took in (`created_cache_tokens`,
            # with --enable-prompt-tokens-details): raypd does not report that count
            details = {k: v for k, v in usage.pop("prompt_tokens_details", {}).items() if k != "created_cache_tokens"}
            out.append(("usage", usage, details))
            continue
        (c,) = e["choices"]
        usage = {k: v for k, v in e["usage"].items() if v is not None} if e.get("usage") else None
        out.append((c["delta"] if "delta" in c else c["text"], c["finish_reason"], usage))
    return out


@pytest.mark.parametrize("path,body,continuous", [
    ("/v1/completions", {"prompt": PROMPT}, False),
    ("/v1/chat/completions", {"messages": MESSAGES}, False),
    ("/v1/completions", {"prompt": PROMPT}, True),
    ("/v1/chat/completions", {"messages": MESSAGES}, True),
], ids=["completions", "chat", "completions-continuous-usage", "chat-continuous-usage"])
def test_a_streamed_answer_has_vllms_chunks(servers, path, body, continuous):
    body = {**body, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": continuous}}
    ours, theirs = shape(stream(servers["raypd"], path, body)), shape(stream(servers["vllm"], path, body))
    print(f"\n{path}\n raypd: {ours}\n vllm:  {theirs}")
    assert ours == theirs
