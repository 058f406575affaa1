"""An MLA model (DeepSeek-V2 style) served P/D on vLLM CPU: the decode answers like a colocated engine.

A tiny random DeepSeek-V2 (2 layers, kv_lora_rank 512 + rope 64 = the 576-wide
latent the CPU MLA kernel supports, block size 16) whose checkpoint says 4 KV
heads: vLLM builds the connector's topology with that count, while the cache
holds one latent row per token.

On the product's path the decode engine receives the prompt plus the
prefill's first token, pulls the whole prompt's latent KV and runs only decode
steps (its first computes the first token's KV), exactly like the colocated
engine after its prefill. (When it replayed the first token, it computed the
last prompt token in vLLM CPU's weight-absorbed MLA decode kernel, where a
colocated engine uses its SDPA prefill; on this random model that changed the
greedy tokens from the second on.)

The model is float32, raypd's CPU default. On a CPU with AMX tiles vLLM would pick its
AMX_MLA backend, which refuses float32 weights; raypd runs the portable CPU_MLA backend
there (`actors.engine.vllm.cpu_kernels`), so the engines start, and the transfer is
asserted, on whichever backend that choice gives on this host.
"""

import asyncio
import json
import random

import platform

import pytest
import ray

from actors.engine.vllm.cpu_kernels import host_cpu_flags, mla_backend_choice

from engine_calls import collect, pd, request, token_ids
from test_vllm_pd import local, make_engine, wait_free

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

rng = random.Random(11)
PROMPTS = {n: [rng.randrange(1000, 40000) for _ in range(n)] for n in (20, 70)}


def build_tiny_mla(path, seed=0):
    """A random float32 DeepseekV2ForCausalLM with SmolLM2's tokenizer (no download)."""
    import torch
    from transformers import AutoTokenizer, DeepseekV2Config, DeepseekV2ForCausalLM

    from actors.models.local import smollm2_path

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path(progress=None), local_files_only=True)
    config = DeepseekV2Config(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=2,  # dense MLPs
        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
        max_position_embeddings=2048, initializer_range=0.1, tie_word_embeddings=False, rope_scaling=None,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = DeepseekV2ForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    assert json.loads((path / "config.json").read_text())["architectures"] == ["DeepseekV2ForCausalLM"]
    return path


@pytest.fixture(scope="module")
def engines(coordinator, tmp_path_factory):
    model = build_tiny_mla(tmp_path_factory.mktemp("models") / "tiny-mla")
    e = {"P": make_engine("prefill", "mla-P", model, "0", block_size=16, model_id="tiny-mla"),
         "D": make_engine("decode", "mla-D", model, "1", block_size=16, model_id="tiny-mla")}
    ray.get([h.start.remote() for h in e.values()])
    yield e
    ray.get([h.shutdown.remote() for h in e.values()])
    for h in e.values():
        ray.kill(h)


def test_both_engines_run_the_mla_backend_raypd_chose_for_this_host(engines):
    expected = mla_backend_choice(host_cpu_flags(), platform.machine(), True, "float32", None).runs
    effective = {k: ray.get(e.effective_config.remote()) for k, e in engines.items()}
    assert {k: (c.dtype, c.mla_backend) for k, c in effective.items()} == {
        "P": ("float32", expected), "D": ("float32", expected)}


@pytest.mark.parametrize("length", sorted(PROMPTS))
def test_mla_latent_kv_pulled_over_nixl_gives_the_colocated_answer(engines, length):
    async def go():
        base = {k: (await e.stats.remote()).num_blocks for k, e in engines.items()}
        req = request(f"mla-{length}", token_ids=PROMPTS[length], max_tokens=12)
        pre = await engines["P"].prefill.remote(req)
        whole_prompt = pre.continuation(req).replace(num_resumed_tokens=0)  # no replay: pull every prompt token
        chunks = await collect(engines["D"], whole_prompt)
        assert (chunks[0].num_cached_tokens, any(c.recomputed for c in chunks)) == (length, False)
        assert token_ids(pre, chunks) == await local(engines["D"], PROMPTS[length])
        for k in ("P", "D"):
            assert (await wait_free(engines[k], base[k])).free_blocks == base[k], k

    asyncio.run(go())


def test_mla_pd_continuation_pulls_every_prompt_token(engines):
    """The product's continuation (prompt + first token, `PrefillResult.continuation`)."""
    async def go():
        length = max(PROMPTS)
        pre, chunks = await pd(engines["P"], engines["D"], request("mla-cont", token_ids=PROMPTS[length],
                                                                   max_tokens=12))
        assert (chunks[0].num_cached_tokens, any(c.recomputed for c in chunks)) == (length, False)
        assert token_ids(pre, chunks) == await local(engines["D"], PROMPTS[length])

    asyncio.run(go())
