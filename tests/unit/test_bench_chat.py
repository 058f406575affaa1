"""`raypd bench --workload chat`: seeded conversations sharing system prompts; turns carry the answers."""

from __future__ import annotations

import argparse
import asyncio
import json

import httpx

from serving.bench.chat import make_conversations, run_conversation, summarize_chat
from serving.cli.main import build_parser


def test_conversations_are_seeded_and_share_their_system_prompts():
    a = make_conversations(7, conversations=6, turns=3, system_prompts=2, system_len=50, user_len=10)
    assert a == make_conversations(7, conversations=6, turns=3, system_prompts=2, system_len=50, user_len=10)
    assert len({c.system for c in a}) == 2 and all(len(c.user_turns) == 3 for c in a)
    other_level = make_conversations(7, 6, 3, 2, 50, 10, level=1)
    assert [c.system for c in other_level] == [c.system for c in a]
    assert other_level[0].user_turns != a[0].user_turns


def fake_server(seen: list[dict]):
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        n = len(seen)
        events = [{"choices": [{"delta": {"content": f" answer{n}"}}]},
                  {"choices": [{"delta": {"content": "."}}]},
                  {"choices": [], "usage": {"prompt_tokens": 100 * n, "completion_tokens": 2,
                                            "prompt_tokens_details": {"cached_tokens": 60 * (n - 1)}}}]
        sse = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, content=sse.encode(), headers={"content-type": "text/event-stream"})
    return handler


def test_each_turn_sends_the_history_with_the_answers_and_usage_gives_the_cached_fraction():
    args = build_parser().parse_args(["bench", "--workload", "chat", "--output-len", "2", "--turns", "3"])
    (conv,) = make_conversations(1, 1, args.turns, 1, 20, 5)
    seen: list[dict] = []

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(fake_server(seen))) as client:
            return await run_conversation(client, "http://x", "m", conv, args, {})

    samples = asyncio.run(go())
    assert [m["role"] for m in seen[2]["messages"]] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert [m["content"] for m in seen[2]["messages"] if m["role"] == "assistant"] == [" answer1.", " answer2."]
    res = summarize_chat(1, samples, 1.0, args)
    assert (res.turns, res.prompt_tokens, res.cached_tokens, res.cached_fraction) == (3, 600, 180, 0.3)


def test_the_workload_flag_defaults_to_the_random_prompts():
    args = build_parser().parse_args(["bench"])
    assert isinstance(args, argparse.Namespace) and args.workload == "random"


def test_compare_reads_each_fronts_prefill_decisions_from_its_metrics():
    from serving.bench.chat_compare import decisions_of

    text = ('# HELP raypd_disagg_decisions_total remote or local prefill\n'
            '# TYPE raypd_disagg_decisions_total counter\n'
            'raypd_disagg_decisions_total{decision="local",reason="prefix_cached"} 9.0\n'
            'raypd_disagg_decisions_total{decision="remote",reason="uncached_prompt"} 3.0\n'
            'raypd_requests_total{endpoint="chat",status="200"} 12.0\n')
    assert decisions_of(text) == {"local/prefix_cached": 9.0, "remote/uncached_prompt": 3.0}
