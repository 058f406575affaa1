"""Shared by the self-healing, migration, hang and chaos tests: steady streaming load over HTTP (each
answer classified by how it ended), killing or freezing an engine's whole process tree, and waiting
for the coordinator to list an engine again."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from dataclasses import dataclass, field

from collections import Counter

import httpx
import psutil
import ray

from serving.cluster.names import actor_name_of


# How an answer ended. Clean: "completed" (a finish reason, then [DONE]), "error_event" (an SSE error
# event, then [DONE]), "http_error" (a status other than 200 with an OpenAI error body). Never
# acceptable: "cut" (the connection ended without [DONE], or the transport failed: RemoteProtocolError)
# and "timeout" (no answer within the client's timeout).
CLEAN = ("completed", "error_event", "http_error")


@dataclass
class Answer:
    prompt: str
    text: str
    error: str | None
    finish_reason: str | None
    started: float
    ended: float
    outcome: str = "completed"
    status: int = 200
    code: str | None = None  # the error body's code (HTTP errors and error events)


@dataclass
class SteadyLoad:
    """`workers` clients, each streaming one completion after another until `stop()`."""

    url: str
    model: str
    prompts: list[str]
    max_tokens: int
    workers: int = 4
    extra: dict = field(default_factory=dict)  # more request fields (ignore_eos: streams of a known length)
    answers: list[Answer] = field(default_factory=list)
    _stop: bool = False
    _tasks: list[asyncio.Task] = field(default_factory=list)

    async def one(self, client: httpx.AsyncClient, prompt: str, max_tokens: int | None = None) -> Answer:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens or self.max_tokens,
                "stream": True, "temperature": 0, **self.extra}
        t0, text, error, finish = time.monotonic(), "", None, None
        outcome, status, code, done = "cut", 0, None, False
        try:
            async with client.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as r:
                status = r.status_code
                if r.status_code != 200:
                    raw = await r.aread()
                    error = f"HTTP {r.status_code}: {raw.decode()[:300]}"
                    try:
                        code = json.loads(raw)["error"]["code"]
                        outcome = "http_error"
                    except (ValueError, KeyError, TypeError):
                        outcome = "cut"  # not an error body: nothing a client can act on
                else:
                    async for line in r.aiter_lines():
                        if line == "data: [DONE]":
                            done = True
                            continue
                        if not line.startswith("data: "):
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            error, code = event["error"]["message"], event["error"].get("code")
                            continue
                        choice = event["choices"][0]
                        text += choice["text"]
                        finish = choice["finish_reason"] or finish
                    if done:
                        outcome = "error_event" if error is not None else "completed" if finish else "cut"
                    if outcome == "cut" and error is None:
                        error = "cut: the stream ended without [DONE]"
        except httpx.TimeoutException as exc:
            outcome, error = "timeout", f"{type(exc).__name__}: {exc}"
        except httpx.HTTPError as exc:  # RemoteProtocolError: the connection was cut mid-stream
            outcome, error = "cut", f"{type(exc).__name__}: {exc}"
        answer = Answer(prompt, text, error, finish, t0, time.monotonic(), outcome, status, code)
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

    def outcomes(self) -> dict[str, int]:
        return dict(Counter(a.outcome for a in self.answers))


async def process_tree(engine) -> list[int]:
    """The engine actor's pid and its children's (rank actors, or vLLM's engine core)."""
    stats = await engine.stats.remote()
    return [stats.pid, *stats.backend.child_pids]


def kill_tree(pids: list[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def freeze_tree(pids: list[int]) -> list[int]:
    """SIGSTOP the processes and all their descendants (what a wedged driver call or a livelocked
    worker looks like); returns every pid stopped, for `kill_tree(pids, signal.SIGCONT)`."""
    import psutil

    stopped = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            procs = [proc, *proc.children(recursive=True)]
        except psutil.Error:
            continue
        for p in procs:
            try:
                p.send_signal(signal.SIGSTOP)
                stopped.append(p.pid)
            except psutil.Error:
                pass
    return stopped


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


def actor_row(engine_id: str) -> dict | None:
    """The engine actor's row in the GCS's actor table (no dashboard needed); None while it has none."""
    import ray._private.state as state

    rows = [a for a in state.actors().values() if a.get("Name") == actor_name_of(engine_id) and a["State"] != "DEAD"]
    return rows[0] if rows else None


async def restarted_pid(engine_id: str, old_pid: int, timeout_s: float) -> int:
    """The pid of the engine actor's next incarnation, as soon as Ray lists it alive."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        row = await asyncio.to_thread(actor_row, engine_id)
        if row is not None and row["State"] == "ALIVE" and row["Pid"] not in (0, old_pid):
            return row["Pid"]
        await asyncio.sleep(0.05)
    raise TimeoutError(f"Ray did not restart {engine_id} within {timeout_s} s")


def running(pid: int, timeout_s: float) -> bool:
    """Whether `pid` still runs (not reaped, not a zombie) after up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return False
        except psutil.Error:
            return False
        if time.monotonic() > deadline:
            return True
        time.sleep(0.5)
