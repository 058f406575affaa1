"""The pure pieces of continuing from prompt + the first token (no engine, no Ray).

`ResumedPenalties` bookkeeping and arithmetic (the worker half), the decode
engine's rules (which parameters replay, what its params become), the
first-token hold-back and `ResumedText` on the embedded model's tokenizer.
"""

from __future__ import annotations

import pickle
import time

import pytest
import torch
from vllm import SamplingParams
from vllm.model_executor.layers.utils import apply_penalties
from vllm.sampling_params import StructuredOutputsParams
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

from actors.decode_caps import NO_CAPS, DecodeCaps, replay_reason
from actors.engine.vllm import decode
from actors.engine.vllm.decode import ResumedText, held_chars
from actors.engine.vllm.resumed import (
    PENALTIES_KEY,
    RESUMED_KEY,
    SKIP_DRAWS_KEY,
    ResumedPenalties,
    apply_batch_update,
    cpu_sampler_draws_once,
)
from actors.models.local import resolve_model
from actors.protocol.request import PrefillResult

CAPS = DecodeCaps(penalties=True, seed_advance=True)


def resumed(pres=0.5, freq=1.0, rep=1.2, k=1) -> SamplingParams:
    return SamplingParams(extra_args={PENALTIES_KEY: [pres, freq, rep], RESUMED_KEY: k})


def update(removed=(), added=(), moved=()) -> BatchUpdate:
    return BatchUpdate(batch_size=8, removed=list(removed), added=list(added), moved=list(moved))


# ---------------------------------------------------------------- the logits processor
def test_bookkeeping_follows_removed_added_moved_in_that_order():
    rows: dict = {}
    out0, out1 = [], [7]
    apply_batch_update(rows, update(added=[(0, resumed(), [1, 2, 3], out0), (1, SamplingParams(), [4], []),
                                           (2, resumed(k=2), [5, 6, 7], out1)]))
    assert set(rows) == {0, 2}  # a request without raypd's penalties has no row
    prompt, prior, out, penalties = rows[2]
    assert prompt.tolist() == [[5]] and prior == [6, 7] and out is out1 and penalties == (0.5, 1.0, 1.2)
    apply_batch_update(rows, update(moved=[(0, 3, MoveDirectionality.UNIDIRECTIONAL)]))
    assert set(rows) == {2, 3} and rows[3][2] is out0
    apply_batch_update(rows, update(moved=[(2, 3, MoveDirectionality.SWAP)]))
    assert rows[2][2] is out0 and rows[3][2] is out1
    # removed before added: a new request may take the freed index in the same update
    apply_batch_update(rows, update(removed=[3], added=[(3, SamplingParams(), [9], [])]))
    assert set(rows) == {2}
    apply_batch_update(rows, update(removed=[2], added=[(2, resumed(), [1, 2], [])]))
    assert set(rows) == {2} and rows[2][1] == [2]
    apply_batch_update(rows, None)  # no change in the batch
    assert set(rows) == {2}


def test_a_resumed_row_is_penalised_as_one_engine_with_the_first_token_as_output():
    torch.manual_seed(0)
    vocab, prompt, first, later = 64, [3, 5, 5, 9], 5, [11, 5]
    logits = torch.randn(3, vocab)
    proc = ResumedPenalties.__new__(ResumedPenalties)  # no vLLM config: the hooks stay out
    proc.rows = {}
    out: list[int] = []
    proc.update_state(update(added=[(1, resumed(0.5, 1.0, 1.2), prompt + [first], out)]))
    out.extend(later)  # the live list: tokens the decode engine sampled since
    got = proc.apply(logits.clone())
    want = logits.clone()
    apply_penalties(want[1:2], torch.tensor([prompt]), torch.tensor([[first] + later]),
                    torch.tensor([0.5]), torch.tensor([1.0]), torch.tensor([1.2]))
    assert torch.equal(got, want)  # bit for bit, and the other rows untouched
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])


def test_the_cpu_sampler_draws_once_per_step():
    assert cpu_sampler_draws_once()  # the generator advance relies on it (else: replay)


# ---------------------------------------------------------------- the decode engine's rules
@pytest.mark.parametrize("params,reason", [
    (dict(temperature=0.0), None),
    (dict(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, logit_bias={3: 1.0}, allowed_token_ids=[1, 2, 3]), None),
    (dict(temperature=0.0, repetition_penalty=1.3, min_tokens=4, stop_token_ids=[7]), None),
    (dict(temperature=0.0, stop=["ab", "x"], logprobs=2), None),
    (dict(temperature=0.0, frequency_penalty=1.0), "penalties"),
    (dict(temperature=0.9, seed=3), "seed"),
    (dict(temperature=0.0, seed=3), None),  # greedy: the seed draws nothing
    (dict(temperature=0.0, bad_words=["hello"]), "bad_words"),  # token ids not known yet
    (dict(temperature=0.0, structured_outputs=StructuredOutputsParams(regex="[ab]+")), "structured_outputs"),
    (dict(temperature=0.0, thinking_token_budget=8), "thinking_token_budget"),
])
def test_replay_reasons(params, reason):
    sp = SamplingParams(**params)
    assert replay_reason(sp, NO_CAPS) == reason
    caps_reason = None if reason in ("penalties", "seed") else reason
    assert replay_reason(sp, CAPS) == caps_reason
    assert replay_reason(sp, DecodeCaps(penalties=True, seed_advance=True, custom_processors=True)) == (
        caps_reason or "logits_processors")


def test_single_token_bad_words_continue_without_a_replay():
    sp = SamplingParams(bad_words=["a"])
    sp._bad_words_token_ids = [[42], [43]]
    assert replay_reason(sp, CAPS) is None
    sp._bad_words_token_ids = [[42, 7]]
    assert replay_reason(sp, CAPS) == "bad_words"


def test_resumed_params_move_penalties_advance_the_seed_and_drop_prompt_logprobs():
    sp = SamplingParams(temperature=0.8, seed=9, presence_penalty=0.5, frequency_penalty=0.25,
                        repetition_penalty=1.1, min_tokens=3, max_tokens=20, prompt_logprobs=1,
                        extra_args={"user": 1})
    sp = pickle.loads(pickle.dumps(sp))  # as the front sends them (skip_reading_prefix_cache resolved)
    assert sp.skip_reading_prefix_cache
    sp = decode.resumed_params(decode.without_prompt_logprobs(sp), 1, 19, CAPS)
    assert (sp.max_tokens, sp.min_tokens) == (19, 2)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.0, 0.0, 1.0)
    assert sp.extra_args == {"user": 1, PENALTIES_KEY: [0.5, 0.25, 1.1], RESUMED_KEY: 1, SKIP_DRAWS_KEY: 1}
    assert sp.prompt_logprobs is None and sp.skip_reading_prefix_cache is False
    plain = decode.resumed_params(SamplingParams(temperature=0.0, repetition_penalty=1.3), 1, 5, CAPS)
    assert plain.repetition_penalty == 1.3 and plain.extra_args is None  # exact as vLLM does it


# ---------------------------------------------------------------- stop strings: hold-back and own text
def test_first_token_hold_back():
    assert held_chars(SamplingParams(stop=["abc", "de"])) == 2
    assert held_chars(SamplingParams(stop=["abc"], include_stop_str_in_output=True)) == 0
    assert held_chars(SamplingParams()) == 0
    going_on = PrefillResult((1,), (2,), " there", "length", kv_transfer_params={"x": 1}, held_chars=2)
    assert going_on.streamed_text == " the"
    short = PrefillResult((1,), (2,), " t", "length", kv_transfer_params={"x": 1}, held_chars=3)
    assert short.streamed_text == ""
    done = PrefillResult((1,), (2,), " there", "stop", held_chars=2)
    assert done.streamed_text == " there"  # the answer is complete: nothing is held


@pytest.fixture(scope="module")
def tokenizer():
    from vllm.tokenizers import get_tokenizer

    return get_tokenizer(str(resolve_model("smollm2")))


def one_engine(tokenizer, prompt, outs, sp):
    """What vLLM's own detokenizer streams for one engine (DELTA): texts per token, stop found."""
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.detokenizer import IncrementalDetokenizer

    req = EngineCoreRequest(request_id="r", prompt_token_ids=list(prompt), mm_features=None, sampling_params=sp,
                            pooling_params=None, arrival_time=time.time(), lora_request=None, cache_salt=None,
                            data_parallel_rank=None)
    d = IncrementalDetokenizer.from_new_request(tokenizer, req)
    texts = []
    for t in outs:
        stop = d.update([t], False)
        texts.append(d.get_next_output_text(stop is not None, True))
        if stop is not None:
            return texts, stop
    return texts, None


@pytest.mark.parametrize("stop", [["xyz"], ["re w"], ["as a"], ["ere was"]])
def test_resumed_text_streams_what_one_engine_streams(tokenizer, stop):
    prompt = tokenizer.encode("Once upon a time")
    outs = tokenizer.encode(" there was a little fox who lived", add_special_tokens=False)
    sp = SamplingParams(stop=stop)
    texts, found = one_engine(tokenizer, prompt, outs, sp)
    first = PrefillResult(tuple(prompt), (outs[0],), tokenizer.decode(outs[:1]), "length",
                          kv_transfer_params={"x": 1}, held_chars=held_chars(sp))
    assert first.streamed_text == texts[0]  # what the router streams at once
    text = ResumedText(tokenizer, prompt, outs[:1], sp)
    ours, got = [first.streamed_text], None
    for t in outs[1:len(texts)]:
        kept, piece, got = text.feed((t,), False, False)
        ours.append(piece)
        assert kept == (t,)
    assert ours == texts and got == found
    if stop == ["re w"]:  # begins in the first token: vLLM decoding from prompt + t1 could not see it
        assert found == "re w" and "".join(ours) == " the"


# ---------------------------------------------------------------- the decode path on a fake engine
class FakeLLM:
    """AsyncLLM.generate replaying scripted deltas (token ids, text, finish reason, stop reason)."""

    def __init__(self, tokenizer, deltas):
        self.tokenizer, self.deltas, self.aborted, self.seen = tokenizer, deltas, [], []

    async def generate(self, prompt, sp, request_id):
        from types import SimpleNamespace

        self.seen.append((list(prompt["prompt_token_ids"]), sp))
        for i, (ids, text, finish, stop_reason) in enumerate(self.deltas):
            o = SimpleNamespace(token_ids=list(ids), text=text, finish_reason=finish, stop_reason=stop_reason,
                                logprobs=None, cumulative_logprob=None)
            yield SimpleNamespace(outputs=[o], finished=finish is not None, num_cached_tokens=0 if i == 0 else None)

    async def abort(self, request_id):
        self.aborted.append(request_id)


def decode_path(llm, caps=CAPS):
    async def no_attach(params):
        raise AssertionError("no pull in these tests")

    wiring = decode.DecodeWiring(engine_id="D", llm=llm, max_model_len=4096, kv_load_failure_policy="fail",
                                 counters={k: 0 for k in ("replays", "replay_mismatches", "inexact_resumes",
                                                          "recomputed", "kv_failures", "kv_pulls")},
                                 attach=no_attach, report_pull=lambda *a: None, handshake_failed=lambda *a: None)
    return decode.DecodePath(wiring, caps)


def resumed_request(tokenizer, prompt, first, max_tokens, **sampling):
    from actors.protocol.request import EngineRequest, SamplingSpec

    sp = SamplingParams(max_tokens=max_tokens, **sampling)
    return EngineRequest("r", SamplingSpec(max_tokens=max_tokens, vllm_params=pickle.dumps(sp)),
                         prompt_token_ids=tuple(prompt) + (first,), num_resumed_tokens=1).with_max_tokens(max_tokens - 1)


async def chunks_of(path, req):
    return [c async for c in path.generate(req, None)]


def test_a_replayed_token_merged_with_the_next_is_dropped_not_taken_for_a_mismatch(tokenizer):
    import asyncio

    from vllm.sampling_params import StructuredOutputsParams

    prompt = tokenizer.encode("Once upon a time")
    outs = tokenizer.encode(" there was a little fox", add_special_tokens=False)
    texts = [tokenizer.decode(outs[:i + 1])[len(tokenizer.decode(outs[:i])):] for i in range(4)]
    # vLLM merged the replay step (t1) with the next one (t2): one delta (t1, t2)
    llm = FakeLLM(tokenizer, [(outs[:2], texts[0] + texts[1], None, None), (outs[2:4], texts[2] + texts[3], "length", None)])
    req = resumed_request(tokenizer, prompt, outs[0], 4, temperature=0.0,
                          structured_outputs=StructuredOutputsParams(regex="[a-z ]+"))
    got = asyncio.run(chunks_of(decode_path(llm), req))
    assert llm.seen[0][0] == prompt and llm.seen[0][1].max_tokens == 4  # the replay: the prompt alone
    assert [c.token_ids for c in got] == [tuple(outs[1:2]), tuple(outs[2:4])]
    assert "".join(c.text for c in got) == "".join(texts[1:4]) and not llm.aborted


def test_a_stop_string_begun_in_the_first_token_ends_the_stream(tokenizer):
    import asyncio

    prompt = tokenizer.encode("Once upon a time")
    outs = tokenizer.encode(" there was a little fox", add_special_tokens=False)
    first = tokenizer.decode(outs[:1])
    llm = FakeLLM(tokenizer, [(outs[1:2], "(vLLM's text is not used)", None, None), (outs[2:3], "x", None, None)])
    req = resumed_request(tokenizer, prompt, outs[0], 8, temperature=0.0, stop=[first[-2:] + " w"])
    got = asyncio.run(chunks_of(decode_path(llm), req))
    assert llm.seen[0][0] == prompt + outs[:1] and llm.seen[0][1].max_tokens == 7  # no replay
    assert len(got) == 1 and got[0].finished and got[0].finish_reason == "stop" and llm.aborted == ["r"]
    # the client had first[:-len(stop)+1]: it gets the rest of the first token's text, before the stop
    held = held_chars(SamplingParams(stop=[first[-2:] + " w"]))
    assert first[:len(first) - held] + got[0].text == first[:-2]
