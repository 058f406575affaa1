"""`raypd profile`'s pure parts: an engine's size from the deployment, one size's rates pooled, the load's rounds."""

from __future__ import annotations

import argparse
import asyncio

import pytest

import serving.cli.profile as profile_command
from actors.rates import EngineRates
from serving.bench.samples import Sample
from serving.cli.profile import engine_size, pooled
from serving.config import DeploymentConfig


def deployment(**group) -> DeploymentConfig:
    return DeploymentConfig.model_validate({"name": "t", "backend": "vllm", "both": {"count": 2, **group}})


def test_an_engines_size_is_its_bound_cores_else_its_cpus_else_its_gpus():
    assert [engine_size(deployment(cpu={"bind": ["0", "1"]}), "both", i) for i in (0, 1)] == [1, 1]
    assert engine_size(deployment(count=1, cpu={"bind": ["0-1"]}), "both", 0) == 2
    assert engine_size(deployment(count=1, cpu={"bind": ["0,2-3"]}), "both", 0) == 3
    assert engine_size(deployment(num_cpus=2), "both", 1) == 2
    assert engine_size(deployment(tp_size=4), "both", 0) == 4


def test_one_sizes_rates_are_pooled_by_their_samples():
    fast = EngineRates(0.04, 0.001, 1 / 600, samples=30, prefill_samples=10)
    slow = EngineRates(0.06, 0.003, 1 / 300, samples=10, prefill_samples=10)
    p = pooled([fast, slow], 1)
    assert (p.cores, p.step_s, p.step_per_stream_s) == (1, pytest.approx(0.045), pytest.approx(0.0015))
    assert p.prefill_tokens_per_s == pytest.approx(400)  # the mean seconds per token: (1/600 + 1/300) / 2


def test_a_decode_engine_that_only_pulls_adds_its_steps_and_a_size_without_prefills_is_none():
    prefill = EngineRates(0.05, 0.0, 1 / 500, samples=4, prefill_samples=4)
    decode = EngineRates(0.03, 0.002, 1 / 400, samples=12, prefill_samples=0)  # its c: the prior
    p = pooled([prefill, decode], 1)
    assert (p.step_s, p.prefill_tokens_per_s) == (pytest.approx(0.035), pytest.approx(500))
    assert pooled([decode], 2) is None


def test_the_load_runs_a_round_per_batch_size_at_least_long_prompts_first(monkeypatch):
    # each round: one long prompt per engine, then `batch` short prompts with long answers per engine
    sent: list[tuple[int, int]] = []

    async def fake_stream(client, url, body, headers, chat, sample):
        sent.append((len(body["prompt"].split()), body["max_tokens"]))
        return Sample(ok=True) if len(sent) != 5 else Sample(ok=False, error="HTTP 503")  # one fails: reported

    monkeypatch.setattr(profile_command, "stream_request", fake_stream)
    args = argparse.Namespace(seed=0, api_key=None, timeout=5.0, prompt_words=600, batches=(1, 2))
    failed = asyncio.run(profile_command._load("http://127.0.0.1:1", "m", 2, 0.0, args))
    long, short = (600, 16), (32, 64)
    assert sent == [long, long, short, short, long, long, *[short] * 4]
    assert failed == ["HTTP 503"]


def test_batch_sizes_must_be_positive_integers():
    assert profile_command._batches("1,2,4,8") == (1, 2, 4, 8)
    for bad in ("", "0,2", "two"):
        with pytest.raises(argparse.ArgumentTypeError, match="streams per engine"):
            profile_command._batches(bad)
