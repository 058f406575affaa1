"""One stream item per engine step (issue 19): merged chunks, one SSE event each, hop stamps (no Ray)."""

from __future__ import annotations

import asyncio
import json

from actors.protocol.request import Stamps, TokenChunk, TokenLogprob
from serving.cluster.merge import merge_ready
from serving.front.trace import HEADER, parse
from test_api import make_client, post, sse_events


def test_merge_concatenates_and_keeps_the_first_verdict_and_the_last_finish():
    a = TokenChunk("r", (1, 2), "ab", num_prompt_tokens=5, num_cached_tokens=4, recomputed=True,
                   stamps=(("engine_in", 1.0),))
    b = TokenChunk("r", (3,), "c", finished=True, finish_reason="length", num_prompt_tokens=5, num_cached_tokens=0)
    m = a.merge(b)
    assert (m.token_ids, m.text, m.finished, m.finish_reason) == ((1, 2, 3), "abc", True, "length")
    assert (m.num_prompt_tokens, m.num_cached_tokens, m.recomputed, m.stamps) == (5, 4, True, (("engine_in", 1.0),))
    err = a.merge(TokenChunk.error_chunk("r", "boom"))
    assert err.failed and not err.failed_before_output and err.error == "boom" and err.token_ids == (1, 2)


def test_merge_concatenates_logprobs_and_keeps_the_later_cumulative():
    lp = lambda t: ((TokenLogprob(t, -0.5 * t, 1),),)  # noqa: E731
    a = TokenChunk("r", (1,), "a", logprobs=lp(1), cumulative_logprob=-0.5)
    b = TokenChunk("r", (2,), "b", logprobs=lp(2), cumulative_logprob=-1.5)
    m = a.merge(b)
    assert m.logprobs == lp(1) + lp(2) and m.cumulative_logprob == -1.5
    plain = TokenChunk("r", (1,), "a").merge(TokenChunk("r", (2,), "b"))
    assert plain.logprobs is None and plain.cumulative_logprob is None
    assert a.merge(TokenChunk("r", finished=True, finish_reason="stop")).cumulative_logprob == -0.5


class FakeGen:
    """What `merge_ready` needs of Ray's ObjectRefGenerator: `next_ready()` and `__anext__`
    giving an awaitable ref (here: items a producer put in a queue; a slow consumer finds several)."""

    def __init__(self):
        self.items: list = []

    def next_ready(self) -> bool:
        return bool(self.items)

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)

        async def ref():
            if isinstance(item, BaseException):
                raise item
            return item

        return ref()


def test_items_that_already_arrived_become_one_chunk_and_a_missing_one_is_not_waited_for():
    gen = FakeGen()
    gen.items = [TokenChunk("r", (2,), "b"), TokenChunk("r", (3,), "c")]
    chunk, failure = asyncio.run(merge_ready(gen, TokenChunk("r", (1,), "a")))
    assert failure is None and chunk.token_ids == (1, 2, 3) and chunk.text == "abc" and not gen.items
    gen.items = [TokenChunk("r", (5,), "e", finished=True, finish_reason="stop"), TokenChunk("r", (9,), "x")]
    chunk, _ = asyncio.run(merge_ready(gen, TokenChunk("r", (4,), "d")))
    assert chunk.token_ids == (4, 5) and chunk.finished and len(gen.items) == 1  # nothing after the end


def test_a_failed_item_ends_the_merge_after_what_arrived_before_it():
    gen = FakeGen()
    gen.items = [TokenChunk("r", (2,), "b"), RuntimeError("engine died"), TokenChunk("r", (3,), "c")]
    chunk, failure = asyncio.run(merge_ready(gen, TokenChunk("r", (1,), "a")))
    assert chunk.token_ids == (1, 2) and isinstance(failure, RuntimeError)


def test_several_tokens_of_one_step_are_one_sse_event_and_the_end_is_one_write():
    client, router = make_client()
    router.chunks = [{"token_ids": [1], "text": " a", "num_prompt_tokens": 7},
                     {"token_ids": [2, 3, 4], "text": " b c d", "num_prompt_tokens": 7},
                     {"token_ids": [5], "text": " e", "finished": True, "finish_reason": "length"}]
    body = {"model": "synthetic-tiny", "prompt": "hi", "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}}
    writes = []
    with client.stream("POST", "/v1/completions", content=json.dumps(body)) as r:
        for part in r.iter_raw():
            writes.append(part)
    events = sse_events(b"".join(writes).decode())
    texts = [e["choices"][0]["text"] for e in events if e["choices"]]
    assert texts == [" a", " b c d", " e"]  # one event per chunk; the last one carries the finish reason
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]] == [None, None, "length"]
    assert events[-1]["usage"]["completion_tokens"] == 5
    # byte for byte the shape of the general encoder (the pre-encoded fast path must not drift)
    assert json.loads(b"".join(writes).decode().split("\n\n")[1][len("data: "):]) == {
        "id": events[0]["id"], "object": "text_completion", "created": events[0]["created"],
        "model": "synthetic-tiny", "choices": [{"index": 0, "text": " b c d", "logprobs": None,
                                                "finish_reason": None}]}


def test_the_trace_header_is_sent_only_when_enabled_and_asked_for():
    body = {"model": "synthetic-tiny", "prompt": "hi", "max_tokens": 3, "stream": True}
    client, _ = make_client(trace=True)
    r = post(client, "/v1/completions", body, headers={HEADER: "1"})
    names = [n for n, _ in parse(r.headers[HEADER])]
    assert names[:2] == [Stamps.FRONT_IN, Stamps.PREPARED] and names[-1] == Stamps.SSE
    assert HEADER not in post(client, "/v1/completions", body).headers
    off, _ = make_client()
    assert HEADER not in post(off, "/v1/completions", body, headers={HEADER: "1"}).headers


def test_chat_chunks_have_vllm_shape_with_continuous_usage():
    """vLLM's server: the role chunk counts the prompt and no answer token, each token chunk the answer
    so far, the last token's chunk carries the finish reason, then the usage chunk with no choices."""
    client, router = make_client()
    router.chunks = [{"token_ids": [1], "text": " a", "num_prompt_tokens": 7, "num_cached_tokens": 0},
                     {"token_ids": [2, 3], "text": " b c"},
                     {"token_ids": [4], "text": " d", "finished": True, "finish_reason": "stop"}]
    body = {"model": "synthetic-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    events = sse_events(post(client, "/v1/chat/completions", body).text)
    shape = [(e["choices"][0]["delta"] if e["choices"] else None,
              e["choices"][0]["finish_reason"] if e["choices"] else None,
              e["usage"]["completion_tokens"]) for e in events]
    assert shape == [({"role": "assistant", "content": ""}, None, 0), ({"content": " a"}, None, 1),
                     ({"content": " b c"}, None, 3), ({"content": " d"}, "stop", 4), (None, None, 4)]
    assert all("prompt_tokens_details" not in e["usage"] for e in events[:-1])  # per-chunk usage: counts only
    assert events[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
