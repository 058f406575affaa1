"""raypd answers like vLLM's own OpenAI server: same request, same tokens.

One model folder (SmolLM2, with a generation_config.json that sets sampling
defaults) served twice: by `python -m vllm.entrypoints.openai.api_server` and
by raypd (1 prefill + 1 decode engine, every request through the P/D path).
Each request goes to both, one at a time; the generated token ids must be
equal. Sampled requests carry a seed (top_k / min_p only matter when
sampling); raypd's decode engine advances the request's generator past the prefill
engine's seeded draw and continues (no replay).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from actors.models.local import resolve_model
from serving.config import DeploymentConfig, load_config
from serving.front import create_app, served_model_of
from serving.ops.health_probe import wait_healthy
from serving.cluster.launcher import launch, shutdown_deployment
from serving.cluster.clients import build_router

from service_helpers import UvicornThread, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NAME = "vllm-semantics"
MAX_MODEL_LEN = 1024
# The model's own defaults: a request that sets neither follows them (vLLM's rule).
GENERATION_DEFAULTS = {"temperature": 0.0, "repetition_penalty": 1.5}
PROMPT = "The three most important things to know about the ocean are"


def model_folder(tmp: Path) -> Path:
    src = resolve_model("smollm2")
    dst = tmp / "SmolLM2-gen-defaults"
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "generation_config.json":
            (dst / f.name).symlink_to(f)
    gen = json.loads((src / "generation_config.json").read_text())
    (dst / "generation_config.json").write_text(json.dumps({**gen, **GENERATION_DEFAULTS}))
    return dst


@pytest.fixture(scope="module")
def servers(coordinator, tmp_path_factory):
    folder = model_folder(tmp_path_factory.mktemp("model"))
    port = free_port()
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    vllm = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
         "--served-model-name", "m", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
         "--enforce-eager", "--port", str(port), "--host", "127.0.0.1", "--seed", "0"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = load_config("configs/local-pd.yaml").model_dump(mode="json")
        base.update(name=NAME, model=str(folder), max_model_len=MAX_MODEL_LEN)
        base["http"]["served_model_name"] = "m"
        for group in ("prefill", "decode"):
            base[group]["num_cpus"] = 0
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
        shutil.rmtree(folder, ignore_errors=True)


def answer(url: str, path: str, body: dict) -> tuple[list[int], str, str]:
    r = httpx.post(url + path, json={"model": "m", "return_token_ids": True, **body}, timeout=300)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return choice["token_ids"], text, choice["finish_reason"]


def both(servers, path: str, body: dict) -> tuple[tuple, tuple]:
    return answer(servers["raypd"], path, body), answer(servers["vllm"], path, body)


def test_sampling_parameters_give_vllms_tokens(servers):
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0.9, "seed": 7, "top_k": 20, "min_p": 0.05,
            "repetition_penalty": 1.2}
    ours, theirs = both(servers, "/v1/completions", body)
    assert ours == theirs


def test_stop_token_ids_give_vllms_tokens(servers):
    free, _ = both(servers, "/v1/completions", {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.0})
    stop_at = free[0][5]  # the sixth greedy token: both must stop right there
    ours, theirs = both(servers, "/v1/completions", {"prompt": PROMPT, "max_tokens": 16, "temperature": 0.0,
                                                     "stop_token_ids": [stop_at]})
    assert ours == theirs and ours[2] == "stop" and len(ours[0]) <= 6


def test_chat_with_sampling_gives_vllms_tokens(servers):
    body = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 16, "temperature": 0.8,
            "seed": 3, "top_k": 10, "min_p": 0.1, "repetition_penalty": 1.1}
    ours, theirs = both(servers, "/v1/chat/completions", body)
    assert ours == theirs


def test_default_request_follows_the_generation_config(servers):
    default, vllm_default = both(servers, "/v1/completions", {"prompt": PROMPT, "max_tokens": 20})
    neutral, _ = both(servers, "/v1/completions", {"prompt": PROMPT, "max_tokens": 20, "temperature": 0.0,
                                                   "repetition_penalty": 1.0})
    assert default == vllm_default and default[0] != neutral[0]


def test_tokenize_round_trips(servers):
    url = servers["raypd"]
    tok = httpx.post(url + "/tokenize", json={"model": "m", "prompt": PROMPT}).json()
    theirs = httpx.post(servers["vllm"] + "/tokenize", json={"model": "m", "prompt": PROMPT}).json()
    assert tok["tokens"] == theirs["tokens"] and tok["count"] == len(tok["tokens"])
    back = httpx.post(url + "/detokenize", json={"model": "m", "tokens": tok["tokens"]}).json()
    assert back["prompt"] == PROMPT
