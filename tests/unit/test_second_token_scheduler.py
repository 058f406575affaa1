"""The CPU engines' scheduler (`actors.engine.vllm.second_token`), run as vLLM's own `Scheduler`
on the embedded model's config (no model weights, no engine): a prompt queued behind a stream's
prefill waits one decode step, so the stream's second token does not wait for its chunk."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from actors.engine.vllm.second_token import SecondTokenScheduler  # noqa: E402
from actors.models.local import resolve_model  # noqa: E402

BUDGET, BLOCK = 128, 16


def scheduler(cls: type[Scheduler]) -> Scheduler:
    model = ModelConfig(model=str(resolve_model("smollm2")), dtype="float32", max_model_len=1024,
                        skip_tokenizer_init=True)
    config = VllmConfig(model_config=model, device_config=DeviceConfig("cpu"),
                        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False),
                        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=BUDGET,
                                                         max_model_len=1024, is_encoder_decoder=False))
    config.cache_config.num_gpu_blocks = 256
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=256, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return cls(config, kv, StructuredOutputManager(config), block_size=BLOCK)


def request(req_id: str, prompt_tokens: int) -> Request:
    return Request(req_id, list(range(1, prompt_tokens + 1)), SamplingParams(max_tokens=8, ignore_eos=True), None)


def step(s: Scheduler) -> dict[str, int]:
    """One step: what it schedules, each request with a token sampled once its prompt is computed."""
    out = s.schedule()
    ids = list(out.num_scheduled_tokens)
    done = {r: [[7]] if s.requests[r].num_computed_tokens >= s.requests[r].num_prompt_tokens else [[]] for r in ids}
    s.update_from_output(out, ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                                sampled_token_ids=[done[r][0] for r in ids]))
    return dict(out.num_scheduled_tokens)


def steps_after_first_token(cls: type[Scheduler]) -> list[dict[str, int]]:
    s = scheduler(cls)
    s.add_request(request("a", 64))
    assert step(s) == {"a": 64}  # a's prefill: its first token
    s.add_request(request("b", 256))  # a prompt arrives behind it
    return [step(s), step(s)]


def test_vllms_scheduler_puts_the_next_prompts_chunk_in_the_streams_second_token_step():
    assert steps_after_first_token(Scheduler)[0] == {"a": 1, "b": BUDGET - 1}


def test_the_second_token_step_carries_no_chunk_and_the_prompt_follows_one_step_later():
    second, third = steps_after_first_token(SecondTokenScheduler)
    assert second == {"a": 1}
    assert third == {"a": 1, "b": BUDGET - 1}


def test_decode_capable_cpu_engines_run_it_and_an_operators_scheduler_wins():
    from actors.engine.vllm.second_token import QUALNAME
    from serving.config import DeploymentConfig

    cfg = DeploymentConfig.from_dict({"prefill": {"count": 1}, "decode": {"count": 1}})
    assert cfg.engine_config("decode").cpu_engine_defaults["scheduler_cls"] == QUALNAME
    assert "scheduler_cls" not in cfg.engine_config("prefill").cpu_engine_defaults
    own = DeploymentConfig.from_dict({"both": {"count": 2}, "engine_kwargs": {"scheduler_cls": "my.Sched"}})
    assert "scheduler_cls" not in own.engine_config("both").cpu_engine_defaults
