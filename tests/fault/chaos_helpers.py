"""Shared by the self-healing, migration and chaos tests: steady streaming load over HTTP, killing an
engine's whole process tree with SIGKILL, and waiting for the coordinator to list an engine again."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass, field

import httpx
import ray


@dataclass
class Answer:
    prompt: str
    text: str
    error: str | None
    finish_reason: str | None
    started: float
    ended: float


@dataclass
class SteadyLoad:
    """`workers` clients, each streaming one completion after another until `stop()`."""

    url: str
    model: str
    prompts: list[str]
    max_tokens: int
    workers: int = 4
    answers: list[Answer] = field(default_factory=list)
    _stop: bool = False
    _tasks: list[asyncio.Task] = field(default_factory=list)

    async def one(self, client: httpx.AsyncClient, prompt: str, max_tokens: int | None = None) -> Answer:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens or self.max_tokens,
                "stream": True, "temperature": 0}
        t0, text, error, finish = time.monotonic(), "", None, None
        try:
            async with client.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as r:
                if r.status_code != 200:
                    error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}"
                else:
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            error = event["error"]["message"]
                            continue
                        choice = event["choices"][0]
                        text += choice["text"]
                        finish = choice["finish_reason"] or finish
        except httpx.HTTPError as exc:
            error = f"{type(exc).__name__}: {exc}"
        answer = Answer(prompt, text, error, finish, t0, time.monotonic())
        self.answers.append(answer)
        return answer

    async def _worker(self, i: int) -> None:
        async with httpx.AsyncClient() as client:
            n = i
            while not self._stop:
                await self.one(client, self.prompts[n % len(self.prompts)])
                n += self.workers

    def start(self) -> "SteadyLoad":
        self._tasks = [asyncio.ensure_future(self._worker(i)) for i in range(self.workers)]
        return self

    async def stop(self) -> list[Answer]:
        self._stop = True
        await asyncio.gather(*self._tasks)
        return self.answers

    def errors(self) -> list[Answer]:
        return [a for a in self.answers if a.error is not None]


async def process_tree(engine) -> list[int]:
    """The engine actor's pid and its children's (rank actors, or vLLM's engine core)."""
    stats = await engine.stats.remote()
    return [stats.pid, *stats.backend.child_pids]


def kill_tree(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


async def wait_generation(coordinator, engine_id: str, after: int, timeout_s: float = 120.0) -> int:
    """Until the coordinator lists `engine_id` with a generation above `after`; returns it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            engines = {e.engine_id: e for e in await coordinator.engines.remote()}
        except ray.exceptions.RayError:
            engines = {}
        gen = engines[engine_id].generation if engine_id in engines else after
        if gen > after:
            return gen
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{engine_id} did not register a new incarnation in {timeout_s}s")


async def generation(coordinator, engine_id: str) -> int:
    return {e.engine_id: e for e in await coordinator.engines.remote()}[engine_id].generation


async def pair_states(coordinator) -> dict:
    return {b.pair: b for b in (await coordinator.transfers.remote()).breakers}


def deployment_placement_groups(name: str) -> list[str]:
    return sorted(i["name"] for i in ray.util.placement_group_table().values()
                  if i.get("state") != "REMOVED" and (i.get("name") or "").startswith(f"raypd-{name}-"))
