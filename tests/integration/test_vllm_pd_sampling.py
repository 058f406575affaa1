"""P/D without the first-token replay: the decode engine's stream equals a colocated one.

A prefill engine and a decode engine (tiny random Llama, float32, prefix caching
off) called as the router calls them. The decode engine continues from prompt +
the prefill's first token: penalties, min_tokens, seeds, stop strings and
logprobs must come out as one engine's, token for token (the colocated
reference runs on the decode engine itself, without transfer params). Both
engines chunk prompts at 64 tokens, so the long prompt is a chunked prefill on
both (a seeded one used to kill the CPU engine) and their KV is computed alike.
"""

import asyncio
import pickle
import random
import time

import pytest
import ray
from vllm import SamplingParams

from actors.engine.actor import EngineActor
from actors.engine.options import engine_actor_options
from actors.control.coordinator import COORDINATOR_NAME
from actors.engine.config import EngineConfig
from actors.models.tiny_llama import build_tiny_llama
from actors.protocol.request import EngineRequest, SamplingSpec
from actors.transfer_config import TransferConfig
from engine_calls import collect

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

Engine = ray.remote(EngineActor)
rng = random.Random(19)
PROMPTS = {n: [rng.randrange(1000, 40000) for _ in range(n)] for n in (40, 150)}
CHUNKED = {"enable_chunked_prefill": True, "max_num_batched_tokens": 64}


def make_engine(role, engine_id, model, bind, **kwargs):
    cfg = EngineConfig(role=role, backend="vllm", engine_id=engine_id, model=str(model), model_id="tiny-s",
                       block_size=32, max_model_len=512, cpu={"bind": bind}, dtype="float32", num_cpus=0,
                       transfer=TransferConfig(lease_ttl_s=60, read_timeout_s=10),
                       engine_kwargs={"enable_prefix_caching": False, "enforce_eager": True, **CHUNKED, **kwargs})
    opts = {k: v for k, v in engine_actor_options(cfg).items() if v is not None}
    return Engine.options(**opts).remote(cfg.model_dump(), COORDINATOR_NAME)


@pytest.fixture(scope="module")
def engines(coordinator, tmp_path_factory):
    model = build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-s", seed=0, progress=None)
    e = {"P": make_engine("prefill", "smp-P", model, "0"),
         "D": make_engine("decode", "smp-D", model, "1", enable_logging_iteration_details=True)}
    ray.get([h.start.remote() for h in e.values()])
    yield e
    ray.get([h.shutdown.remote() for h in e.values()])
    for h in e.values():
        ray.kill(h)


def req(rid, prompt, max_tokens=12, **sampling):
    sp = SamplingParams(max_tokens=max_tokens, **sampling)
    spec = SamplingSpec(max_tokens=max_tokens, temperature=sp.temperature, seed=sp.seed,
                        stop=tuple(sp.stop or ()), vllm_params=pickle.dumps(sp))
    return EngineRequest(rid, spec, prompt_token_ids=tuple(prompt))


async def colocated(engines, prompt, **kw):
    chunks = await collect(engines["D"], req(f"c{time.monotonic_ns()}", prompt, **kw))
    return answer([], "", None, chunks)


async def pd(engines, prompt, cached=None, **kw):
    """Prefill on P, continue on D; `cached`: the prompt tokens D must have pulled (all of them)."""
    r = req(f"p{time.monotonic_ns()}", prompt, **kw)
    pre = await engines["P"].prefill.remote(r)
    if not pre.needs_decode:
        return answer(list(pre.first_token_ids), pre.first_text, pre.first_logprobs, []), pre, []
    chunks = await collect(engines["D"], pre.continuation(r))
    assert chunks and not chunks[0].recomputed and chunks[0].num_cached_tokens == (
        len(prompt) if cached is None else cached), chunks[0]
    return answer(list(pre.first_token_ids), pre.streamed_text, pre.first_logprobs, chunks), pre, chunks


def answer(tokens, text, logprobs, chunks):
    """What a client sees: token ids, text, finish reason, logprobs (sampled token's) and the total."""
    lps = list(logprobs or ())
    for c in chunks:
        tokens += list(c.token_ids)
        text += c.text
        lps += list(c.logprobs or ())
    last = chunks[-1] if chunks else None
    return {"tokens": tokens, "text": text, "finish": last.finish_reason if last else None,
            "logprobs": [[(e.token_id, round(e.logprob, 4)) for e in pos] for pos in lps],
            "cumulative": round(last.cumulative_logprob, 3) if last and last.cumulative_logprob is not None else None}


CASES = {
    "greedy": dict(temperature=0.0),
    "greedy penalties": dict(temperature=0.0, frequency_penalty=2.0, presence_penalty=1.5),
    "greedy repetition": dict(temperature=0.0, repetition_penalty=1.8),
    "greedy min_tokens": dict(temperature=0.0, min_tokens=6),
    "seeded": dict(temperature=1.0, seed=1234, top_k=50),
    "seeded penalties": dict(temperature=0.9, seed=7, frequency_penalty=1.0, presence_penalty=0.5,
                             repetition_penalty=1.2),
    "seeded logprobs": dict(temperature=0.8, seed=3, logprobs=2),
    "greedy logprobs penalties": dict(temperature=0.0, logprobs=1, frequency_penalty=1.0),
    "no-match 2-char stop": dict(temperature=0.0, stop=["\u00a7\u00b6"]),
    "no-match 4-char stop": dict(temperature=0.9, seed=11, stop=["\u00a7\u00b6\u00a7\u00b6"]),
}


@pytest.mark.parametrize("length", sorted(PROMPTS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_pd_stream_equals_colocated(engines, case, length):
    async def go():
        want = await colocated(engines, PROMPTS[length], **CASES[case])
        got, _, _ = await pd(engines, PROMPTS[length], **CASES[case])
        assert got == want

    asyncio.run(go())


@pytest.mark.parametrize("where", ["t1|t2", "t4|t5"])
def test_stop_strings_end_the_stream_where_one_engine_ends_it(engines, where):
    """A stop string that begins in one token's text and ends in the next one's; t1|t2: it begins
    in the prefill engine's token, which the decode engine has as prompt."""
    i = 0 if where == "t1|t2" else 3
    async def go():
        for seed in range(16):  # a prompt whose tokens' texts are long enough for such a stop string
            prompt = [random.Random(seed).randrange(1000, 40000) for _ in range(40)]
            chunks = await collect(engines["D"], req(f"t{seed}", prompt, temperature=0.0))
            texts = [c.text for c in chunks if c.token_ids]
            # a texts entry is one token's only when no chunk carries more (vLLM merges the deltas of a
            # slow consumer), and the answer may end (EOS) before token i + 1
            one_each = all(len(c.token_ids) == 1 for c in chunks if c.token_ids)
            if not one_each or len(texts) < i + 2 or len(texts[i]) < 2 or len(texts[i + 1]) < 2:
                continue
            stop, at = texts[i][-2:] + texts[i + 1][:2], len("".join(texts[:i + 1])) - 2
            if "".join(texts).find(stop) == at:
                break
        else:
            pytest.skip("no prompt gave tokens whose texts allow the stop string")
        for include in (False, True):
            kw = dict(temperature=0.0, stop=[stop], include_stop_str_in_output=include)
            want = await colocated(engines, prompt, **kw)
            got, _, _ = await pd(engines, prompt, **kw)
            assert want["finish"] == "stop" and got == want, (stop, include)
            assert len(want["tokens"]) == i + 2

    asyncio.run(go())


def test_decode_computes_only_the_first_token_before_sampling_the_second(engines):
    """vLLM's own counters on the decode engine: one step that computed one (context) token."""
    async def settled():
        """The counters once the engine is idle (an aborted request may still run one step)."""
        last = None
        while True:
            counters = (await engines["D"].stats.remote()).backend.counters
            if counters == last and counters["engine_running"] == 0:
                return counters
            last = counters
            await asyncio.sleep(0.3)

    async def go():
        prompt = PROMPTS[40]
        before = await settled()
        got, pre, chunks = await pd(engines, prompt, max_tokens=2, temperature=0.0)
        after = await settled()
        delta = {k: after[k] - before[k] for k in after if k.startswith(("prompt_", "compute_"))}
        assert delta == {"prompt_tokens": len(prompt) + 1, "prompt_tokens_computed": 1,
                         "prompt_tokens_pulled": len(prompt), "prompt_tokens_cached": 0,
                         "compute_steps": 1, "compute_steps_ctx_tokens": 1, "compute_steps_gen_tokens": 0}
        assert len(got["tokens"]) == 2 and after["replays"] == before["replays"]
        assert got == await colocated(engines, prompt, max_tokens=2, temperature=0.0)

    asyncio.run(go())


def test_seeded_chunked_prefill_does_not_kill_the_engines(engines):
    """150 tokens at 64 a step: vLLM rewinds the generator of each discarded sample, which a CPU
    generator refuses; the engines sample those rows without it and stay alive."""
    async def go():
        for _ in range(2):
            got, _, _ = await pd(engines, PROMPTS[150], temperature=1.0, seed=5)
            assert got == await colocated(engines, PROMPTS[150], temperature=1.0, seed=5)
        for e in engines.values():
            assert await e.check_health.remote()

    asyncio.run(go())


def test_structured_outputs_replay_the_first_token(engines):
    from vllm.sampling_params import StructuredOutputsParams

    async def go():
        kw = dict(temperature=0.0, structured_outputs=StructuredOutputsParams(regex="[a-z]{3,12}"), max_tokens=8)
        before = (await engines["D"].stats.remote()).backend.counters
        want = await colocated(engines, PROMPTS[40], **kw)
        got, _, chunks = await pd(engines, PROMPTS[40], cached=39, **kw)  # the replay computes the last one
        after = (await engines["D"].stats.remote()).backend.counters
        assert got == want
        assert after["replays"] - before["replays"] == 1 and after["replay_mismatches"] == before["replay_mismatches"]

    asyncio.run(go())
