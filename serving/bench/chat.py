"""`raypd bench --workload chat`: seeded multi-turn conversations that share system prompts.

  raypd bench --workload chat --url http://127.0.0.1:8000 --concurrency 1,4 --conversations 16 --turns 4 \
      --system-prompts 2 --system-len 300 --user-len 40 --output-len 32 --json-out chat.json

Workload (seeded by `--seed`): `--system-prompts` system prompts of
`--system-len` words; `--conversations` conversations per concurrency level,
each on one of the system prompts (round robin), with `--turns` user messages of
`--user-len` words. Turn k sends the system prompt, the k user messages and the
k-1 answers the server gave (as a chat client does), so a conversation's turns
share a growing prefix and conversations share their system prompt: prefix reuse
is what this workload measures.

For each concurrency C, C conversations are in flight at once; a conversation's
turns run one after the other, each sent when the previous answer is complete;
every request streams greedily with `max_tokens=--output-len`, ignore_eos.
Printed per level: TTFT / ITL / e2e percentiles, TTFT of first turns vs later
turns, and the fraction of prompt tokens served from cache
(`usage.prompt_tokens_details.cached_tokens` / `usage.prompt_tokens`, when the
server reports them).
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict, dataclass
from typing import Any

from serving.bench.samples import WORDS, LevelResult, Sample, closed_loop, percentile, print_level, summarize
from serving.bench.sse import stream_request, target


@dataclass(frozen=True)
class Conversation:
    system: str
    user_turns: tuple[str, ...]


def make_conversations(seed: int, conversations: int, turns: int, system_prompts: int, system_len: int,
                       user_len: int, level: int = 0) -> list[Conversation]:
    """The same arguments give the same conversations; `level` varies the user turns, not the systems."""
    systems_rng = random.Random(seed)
    systems = [f"You are assistant number {i}. " + " ".join(systems_rng.choice(WORDS) for _ in range(system_len))
               for i in range(system_prompts)]
    rng = random.Random(f"{seed}-{level}")
    return [Conversation(systems[c % len(systems)],
                         tuple(f"Question {t + 1}: " + " ".join(rng.choice(WORDS) for _ in range(user_len))
                               for t in range(turns)))
            for c in range(conversations)]


@dataclass
class TurnSample(Sample):
    turn: int = 0
    prompt_tokens: int = 0
    cached_tokens: int | None = None

    def usage(self, usage: dict) -> None:
        self.output_tokens = usage.get("completion_tokens", 0)
        self.prompt_tokens = usage.get("prompt_tokens", 0)
        self.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")


async def run_conversation(client: Any, url: str, model: str, conv: Conversation, args: argparse.Namespace,
                           headers: dict) -> list[TurnSample]:
    messages: list[dict] = [{"role": "system", "content": conv.system}]
    samples = []
    for turn, question in enumerate(conv.user_turns, start=1):
        messages.append({"role": "user", "content": question})
        body = {"model": model, "messages": list(messages), "max_tokens": args.output_len, "stream": True,
                "stream_options": {"include_usage": True}, "temperature": 0.0, "ignore_eos": True}
        sample = await stream_request(client, url, body, headers, True, TurnSample(ok=False, turn=turn))
        samples.append(sample)
        if not sample.ok:
            break  # the conversation cannot go on without its answer
        messages.append({"role": "assistant", "content": sample.text})
    return samples


@dataclass
class ChatLevelResult:
    level: LevelResult
    turns: int
    ttft_first_turn_ms: dict
    ttft_later_turns_ms: dict
    prompt_tokens: int
    cached_tokens: int | None
    cached_fraction: float | None


def summarize_chat(concurrency: int, samples: list[TurnSample], wall_s: float, args: argparse.Namespace
                   ) -> ChatLevelResult:
    level = summarize(concurrency, list(samples), wall_s, args.slo_ttft_ms / 1000, args.slo_itl_ms / 1000)
    ok = [s for s in samples if s.ok]

    def pct(values: list[float]) -> dict:
        return {f"p{q}": round(percentile(values, q) * 1000, 3) for q in (50, 90)}

    prompt = sum(s.prompt_tokens for s in ok)
    reported = [s.cached_tokens for s in ok if s.cached_tokens is not None]
    cached = sum(reported) if reported else None
    return ChatLevelResult(
        level=level, turns=len(samples),
        ttft_first_turn_ms=pct([s.ttft for s in ok if s.turn == 1]),
        ttft_later_turns_ms=pct([s.ttft for s in ok if s.turn > 1]),
        prompt_tokens=prompt, cached_tokens=cached,
        cached_fraction=round(cached / prompt, 4) if cached is not None and prompt else None,
    )


def print_chat_level(r: ChatLevelResult) -> None:
    print_level(r.level)
    print(f"  TTFT ms p50/p90 first turns {r.ttft_first_turn_ms['p50']:8.2f} / {r.ttft_first_turn_ms['p90']:8.2f}"
          f"   later turns {r.ttft_later_turns_ms['p50']:8.2f} / {r.ttft_later_turns_ms['p90']:8.2f}")
    frac = "not reported by the server" if r.cached_fraction is None else f"{r.cached_fraction:.1%}"
    print(f"  prompt tokens served from cache: {frac} (of {r.prompt_tokens})", flush=True)


async def run_chat_load(args: argparse.Namespace, url: str | None = None, seed: int | None = None
                        ) -> list[ChatLevelResult]:
    """Every concurrency level against `url` (default `--url`); `seed` (default `--seed`) picks the texts."""
    seed = args.seed if seed is None else seed
    async with target(args, url) as t:
        client, url, headers, model, levels = t.client, t.url, t.headers, t.model, t.levels
        warm = Conversation("Warm-up.", ("warm up " * 8,))
        await run_conversation(client, url, model, warm, args, headers)  # handshakes, connections
        results = []
        for i, c in enumerate(levels):
            convs = make_conversations(seed, args.conversations, args.turns, args.system_prompts,
                                       args.system_len, args.user_len, level=i)
            per_conv, wall = await closed_loop(
                lambda k: run_conversation(client, url, model, convs[k], args, headers), c, len(convs))
            res = summarize_chat(c, [s for conv in per_conv for s in conv], wall, args)
            results.append(res)
            print_chat_level(res)
    return results


def run_chat(args: argparse.Namespace) -> int:
    import asyncio

    results = asyncio.run(run_chat_load(args))
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump([asdict(r) for r in results], fh, indent=2)
    return 0 if all(r.level.errors == 0 for r in results) else 1


def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", choices=["random", "chat"], default="random",
                   help="random: independent prompts; chat: multi-turn conversations sharing system prompts")
    p.add_argument("--conversations", type=int, default=16, help="chat: conversations per concurrency level")
    p.add_argument("--turns", type=int, default=4, help="chat: user turns per conversation")
    p.add_argument("--system-prompts", type=int, default=2, help="chat: distinct system prompts")
    p.add_argument("--system-len", type=int, default=300, help="chat: system prompt length in words")
    p.add_argument("--user-len", type=int, default=40, help="chat: user message length in words")
    p.add_argument("--compare-routing", metavar="CONFIG", default=None,
                   help="chat: start CONFIG's engines (e.g. configs/local.yaml) and run the workload through two "
                        "fronts on them, cache-aware routing + conditional P/D on vs off (serving/bench/chat_compare.py)")
    p.add_argument("--chat-results", default="benchmarks/results/chat_routing.json",
                   help="--compare-routing: write the results here (JSON, and the printed table as .txt); '' for none")
