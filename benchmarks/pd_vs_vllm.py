#!/usr/bin/env python
"""raypd P/D against colocated vLLM and vLLM's own NixlConnector P/D, one machine, one run.

  .venv/bin/python benchmarks/pd_vs_vllm.py [--lengths 128,512,2048] [--reps 8,6,4]
      [--max-tokens 16] [--plot pd.png] [--out pd.json]

Model: SmolLM2-135M-Instruct (the embedded model, `resolve_model("smollm2")`),
float32, enforce_eager, prefix caching off, greedy, one core per engine
(VLLM_CPU_OMP_THREADS_BIND "0" / "1"), loopback only. The three set-ups run one
after the other, each alone on the machine, with the same prompts (random token
ids, a fresh prompt per request so nothing is cached):

  (a) colocated  one EngineActor, role "both", plain vLLM AsyncLLM with no KV
                 connector (EngineConfig.kv_connector=False), bound to core 0;
                 the client streams EngineActor.generate over Ray;
  (b) raypd P/D  Coordinator + prefill EngineActor (core 0) + decode EngineActor
                 (core 1), both with RayNixlConnector, driven exactly like
                 tests/integration/test_vllm_pd.py: prefill() returns the first
                 token and the transfer params -- TTFT is when it returns, the
                 token is the client's -- then the decode engine streams the rest
                 from prompt + first token, pulling the prompt's KV over NIXL;
  (c) vLLM P/D   two `vllm.entrypoints.openai.api_server` processes with
                 --kv-transfer-config NixlConnector/kv_both (cores 0 / 1,
                 distinct VLLM_NIXL_SIDE_CHANNEL_PORT), driven the way vLLM's
                 toy_proxy_server.py does it (no proxy process: the same two
                 requests from this client): a non-streamed prefill request with
                 max_tokens 1 and kv_transfer_params {do_remote_decode: true, ...},
                 then the streamed decode request with the returned params; its
                 first streamed token is the client's TTFT.

Per set-up: TTFT median/p90 per prompt length, inter-token latency (median of
the gaps between streamed tokens after the second token), the first->second
token gap (for (b) it holds the KV pull and the first decode step), the decode
request's own time to its first token, KV bytes moved (b: computed from the
transfer params and the cache geometry; c: vLLM's nixl_bytes_transferred
metric) and transfer time where the engine reports it (c: vLLM's
nixl_xfer_time_seconds), whether the tokens equal (a)'s, and the idle CPU of
every engine's process tree (the EngineActor or API server and all its
children, /proc/<pid>/stat utime+stime over --idle-s seconds after warm-up, in %
of one core). Ratios (b)/(a) and (c)/(a) are printed. raypd's goals: TTFT(b)
<= 1.15 x TTFT(a) and < TTFT(c); idle engines < 2 % of a core.

Every process started here (Ray cluster, actors and their vLLM children, API
servers and theirs) is stopped before exit, also on errors and SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import math
import os
import platform
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any
from serving.bench import percentile  # noqa: E402

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RAY_TEMP = "/tmp/raypd-bench-ray"
CLK_TCK = os.sysconf("SC_CLK_TCK")
SETUPS = ("a", "b", "c")
NAMES = {"a": "(a) colocated vLLM", "b": "(b) raypd P/D (RayNixlConnector)", "c": "(c) vLLM P/D (NixlConnector)"}


# ------------------------------------------------------------------ helpers
pct = percentile  # one percentile definition for every benchmark (serving/bench.py)


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_prompts(lengths: list[int], reps: list[int], seed: int, vocab: int) -> dict[int, list[list[int]]]:
    rng = random.Random(seed)
    return {n: [[rng.randrange(1000, min(40000, vocab)) for _ in range(n)] for _ in range(r)]
            for n, r in zip(lengths, reps)}


# ------------------------------------------------------ process trees / CPU
def children_of(pid: int) -> list[int]:
    kids = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                kids += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
            except OSError:
                pass
    except OSError:
        pass
    return kids


def tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p in out:
            continue
        out.append(p)
        todo += children_of(p)
    return out


def cpu_ticks(pid: int) -> int | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()
    return int(fields[11]) + int(fields[12])  # utime + stime (fields 14, 15)


def proc_name(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"
    if "multiprocessing.resource_tracker" in cmd:
        return "resource_tracker"
    if "vllm.entrypoints.openai.api_server" in cmd:
        return "api_server"
    return cmd.split(" ")[0][:40] if cmd.startswith(("ray::", "VLLM::")) else comm


def affinity(pid: int) -> str:
    """Cpus_allowed_list of the process's threads (distinct values, main thread first)."""
    seen: list[str] = []
    try:
        tasks = sorted(os.listdir(f"/proc/{pid}/task"), key=lambda t: (t != str(pid), int(t)))
        for t in tasks:
            for line in Path(f"/proc/{pid}/task/{t}/status").read_text().splitlines():
                if line.startswith("Cpus_allowed_list:"):
                    v = line.split(":", 1)[1].strip()
                    if v not in seen:
                        seen.append(v)
    except OSError:
        pass
    return "/".join(seen)


def measure_idle(roots: dict[str, int], seconds: float) -> dict[str, Any]:
    """% of one core used by each root's process tree over `seconds` (nothing else sent meanwhile)."""
    trees = {k: tree(p) for k, p in roots.items()}
    before = {k: {p: cpu_ticks(p) for p in ps} for k, ps in trees.items()}
    t0 = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - t0
    out: dict[str, Any] = {}
    for k, ps in trees.items():
        procs = []
        total = 0
        for p in ps:
            a, b = before[k][p], cpu_ticks(p)
            if a is None or b is None:
                continue
            used = (b - a) / CLK_TCK
            total += b - a
            procs.append({"pid": p, "name": proc_name(p), "cpu_pct": round(100 * used / wall, 2),
                          "affinity": affinity(p)})
        out[k] = {"cpu_pct_of_one_core": round(100 * total / CLK_TCK / wall, 2), "wall_s": round(wall, 2),
                  "processes": procs}
    return out


# ------------------------------------------------------------------ records
def summarize(samples: list[dict]) -> dict:
    ok = [s for s in samples if s.get("ok")]
    ttft = [s["ttft"] for s in ok]
    itl = [g for s in ok for g in s["gaps"][1:]]
    first_gap = [s["gaps"][0] for s in ok if s["gaps"]]
    out = {
        "n": len(samples), "ok": len(ok),
        "ttft_median_s": med(ttft), "ttft_p90_s": pct(ttft, 90),
        "itl_median_s": med(itl), "first_gap_median_s": med(first_gap),
        "e2e_median_s": med([s["e2e"] for s in ok]),
        "tokens_median": med([len(s["tokens"]) for s in ok]),
        "errors": [s.get("error") for s in samples if not s.get("ok")],
    }
    for key in ("decode_ttft", "prefill_s", "kv_bytes"):
        vals = [s[key] for s in ok if s.get(key) is not None]
        if vals:
            out[f"{key}_median"] = med(vals)
    return out


def chunk_gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


# ------------------------------------------------------------------ (a), (b): Ray actors
async def stream_actor(engine: Any, req: dict, t0: float) -> tuple[list[int], list[float], str]:
    tokens, times, text = [], [], ""
    async for ref in engine.generate.options(num_returns="streaming").remote(req):
        chunk = await ref
        now = time.perf_counter()
        if chunk.get("finish_reason") == "error":
            raise RuntimeError(chunk.get("error", "engine error"))
        for t in chunk["token_ids"]:
            tokens.append(t)
            times.append(now)
        text += chunk.get("text") or ""
    return tokens, times, text


async def one_colocated(engine: Any, prompt: list[int], max_tokens: int) -> dict:
    rid = f"a-{uuid.uuid4().hex[:10]}"
    t0 = time.perf_counter()
    try:
        tokens, times, _ = await stream_actor(engine, {"request_id": rid, "prompt_token_ids": prompt,
                                                       "max_tokens": max_tokens}, t0)
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        return {"ok": False, "error": repr(exc)}
    if not times:
        return {"ok": False, "error": "no tokens"}
    return {"ok": True, "ttft": times[0] - t0, "e2e": times[-1] - t0, "gaps": chunk_gaps(times), "tokens": tokens}


async def one_raypd(prefill: Any, decode: Any, prompt: list[int], max_tokens: int, geom: dict) -> dict:
    rid = f"b-{uuid.uuid4().hex[:10]}"
    t0 = time.perf_counter()
    try:
        pre = await prefill.prefill.remote({"request_id": rid, "prompt_token_ids": prompt,
                                            "max_tokens": max_tokens})
        t_first = time.perf_counter()
        params = pre["kv_transfer_params"]
        if not params:
            return {"ok": False, "error": f"prefill gave no transfer params (finish {pre['finish_reason']})"}
        t_dec = time.perf_counter()
        tokens, times, _ = await stream_actor(decode, {
            "request_id": rid + "-d", "prompt_token_ids": pre["prompt_token_ids"] + pre["first_token_ids"],
            "max_tokens": max_tokens - 1, "kv_transfer_params": params}, t_dec)
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "error": repr(exc)}
    blocks = math.ceil(int(params["num_tokens"]) / int(params["block_size"]))
    all_times = [t_first] + times
    return {"ok": True, "ttft": t_first - t0, "e2e": all_times[-1] - t0, "gaps": chunk_gaps(all_times),
            "tokens": list(pre["first_token_ids"]) + tokens, "prefill_s": t_first - t0,
            "decode_ttft": (times[0] - t_dec) if times else None,
            "kv_bytes": blocks * geom["layers"] * geom["bytes_per_token_layer"] * int(params["block_size"])}


# ------------------------------------------------------------------ (c): vLLM API servers
def prom_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            try:
                total += float(line.rsplit(" ", 1)[1])
            except ValueError:
                pass
    return total


async def nixl_metrics(client: Any, url: str) -> dict:
    try:
        text = (await client.get(url + "/metrics")).text
    except Exception:  # noqa: BLE001
        return {}
    return {k: prom_sum(text, f"vllm:{k}") for k in (
        "nixl_bytes_transferred_sum", "nixl_bytes_transferred_count",
        "nixl_xfer_time_seconds_sum", "nixl_xfer_time_seconds_count", "nixl_num_failed_transfers_total")}


async def one_vllm_pd(client: Any, p_url: str, d_url: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    rid = str(uuid.uuid4())
    headers = {"X-Request-Id": rid}
    body = {"model": model, "prompt": prompt, "temperature": 0.0, "return_token_ids": True}
    pre_body = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
        "remote_block_ids": None, "remote_host": None, "remote_port": None}}
    t0 = time.perf_counter()
    try:
        r = await client.post(p_url + "/v1/completions", json=pre_body, headers=headers)
        r.raise_for_status()
        t_pre = time.perf_counter()
        params = r.json().get("kv_transfer_params")
        if not params:
            return {"ok": False, "error": "prefill returned no kv_transfer_params"}
        dec_body = {**body, "max_tokens": max_tokens, "stream": True, "kv_transfer_params": params}
        tokens, times = [], []
        async with client.stream("POST", d_url + "/v1/completions", json=dec_body, headers=headers) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                now = time.perf_counter()
                for ch in obj.get("choices") or []:
                    ids = ch.get("token_ids")
                    if ids is None:
                        ids = [None] if ch.get("text") else []
                    for t in ids:
                        tokens.append(t)
                        times.append(now)
    except Exception as exc:  # noqa: BLE001
        return {"ok": False, "error": repr(exc)}
    if not times:
        return {"ok": False, "error": "no tokens"}
    return {"ok": True, "ttft": times[0] - t0, "e2e": times[-1] - t0, "gaps": chunk_gaps(times),
            "tokens": tokens, "prefill_s": t_pre - t0, "decode_ttft": times[0] - t_pre}


class ApiServer:
    """One `vllm.entrypoints.openai.api_server` in its own process group."""

    def __init__(self, name: str, model: str, port: int, side_port: int, bind: str, args: argparse.Namespace,
                 log_dir: Path):
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        env = dict(os.environ)
        env.update({"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib),
                    "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port), "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                    "VLLM_LOGGING_LEVEL": "WARNING"})
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
                    "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(port),
                    "--dtype", "float32", "--enforce-eager", "--max-model-len", str(args.max_model_len),
                    "--no-enable-prefix-caching", "--seed", "0", "--disable-uvicorn-access-log",
                    "--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})]
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=str(ROOT))

    async def wait_ready(self, client: Any, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}:\n"
                                   + self.tail())
            try:
                if (await client.get(self.url + "/health", timeout=2)).status_code == 200:
                    return
            except Exception:  # noqa: BLE001 - not up yet
                pass
            await asyncio.sleep(1.0)
        raise TimeoutError(f"{self.name} not ready in time; see {self.log_path}:\n" + self.tail())

    def tail(self, n: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, timeout: float = 30.0) -> list[int]:
        """SIGTERM the whole process group, SIGKILL what is left; returns pids still alive."""
        pids = tree(self.proc.pid)
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(alive(p) for p in pids):
            time.sleep(0.2)
        for p in pids:
            if alive(p):
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=10)
        self._log.close()
        time.sleep(0.5)
        return [p for p in pids if alive(p)]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# ------------------------------------------------------------------ phases
async def run_requests(name: str, fn, prompts: dict[int, list[list[int]]], deadline: float,
                       metrics=None) -> dict[int, list[dict]]:
    """Requests one at a time, round-robin over the prompt lengths (so a time budget cuts every length
    alike); `metrics` (optional) is scraped around each request and the delta kept with the sample."""
    out: dict[int, list[dict]] = {n: [] for n in prompts}
    order = [(i, n) for i in range(max(len(v) for v in prompts.values())) for n in prompts if i < len(prompts[n])]
    for i, n in order:
        if time.monotonic() > deadline:
            log(f"{name}: phase time budget reached; skipping the remaining requests")
            break
        before = await metrics() if metrics else None
        sample = await fn(prompts[n][i])
        sample["idx"] = i  # the same prompt index in every set-up
        if metrics:
            after = await metrics()
            sample["metrics_delta"] = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        out[n].append(sample)
        log(f"{name}: {n:>5} tokens #{i}: " + (f"TTFT {sample['ttft'] * 1e3:.0f} ms" if sample.get("ok")
                                               else f"failed: {sample.get('error')}"))
    return out


async def idle_windows(name: str, roots: dict[str, int], args, t_end: float, results: dict,
                       wait_settled=None) -> None:
    """Idle CPU right after the warm-up (window 1), then once settled (window 2)."""
    await asyncio.sleep(max(0.0, t_end + args.settle_s - time.monotonic()))
    after = await asyncio.to_thread(measure_idle, roots, args.idle_s)
    if wait_settled is not None:
        await wait_settled()
        await asyncio.sleep(2.0)
    await asyncio.sleep(max(0.0, t_end + args.settled_after_s - time.monotonic()))
    settled = await asyncio.to_thread(measure_idle, roots, args.idle_s)
    results["idle_after_warmup"][name] = after
    results["idle"][name] = settled
    for d in (after, settled):
        for v in d.values():
            results["seen_pids"].extend(p["pid"] for p in v["processes"])
    log(f"{name} idle % of a core, right after warm-up: "
        + ", ".join(f"{k} {v['cpu_pct_of_one_core']}" for k, v in after.items())
        + "; settled: " + ", ".join(f"{k} {v['cpu_pct_of_one_core']}" for k, v in settled.items()))


async def actor_pid(handle: Any) -> int:
    return await handle.__ray_call__.remote(lambda self: os.getpid())


async def phase_colocated(args, prompts, warm, results, cleanup) -> None:
    import ray

    from actors.engine import EngineActor, engine_actor_options
    from actors.engine_config import EngineConfig

    cfg = EngineConfig(role="both", backend="vllm", engine_id="bench-colocated", model=args.model,
                       max_model_len=args.max_model_len, kv_cache_space_gib=args.kv_cache_gib, cpu_bind="0",
                       enable_prefix_caching=False, num_cpus=0, kv_connector=False)
    opts = {k: v for k, v in engine_actor_options(cfg).items() if v is not None}
    engine = ray.remote(EngineActor).options(**opts).remote(cfg.model_dump())
    cleanup.append(("actor", engine))
    t0 = time.monotonic()
    await asyncio.wait_for(engine.start.remote(), args.start_timeout_s)
    results["startup_s"]["a"] = time.monotonic() - t0
    log(f"(a) colocated engine up in {results['startup_s']['a']:.0f} s")
    pid = await actor_pid(engine)
    for p in warm:
        await one_colocated(engine, p, args.max_tokens)
    await idle_windows("a", {"engine": pid}, args, time.monotonic(), results)
    deadline = time.monotonic() + args.phase_budget_s
    results["samples"]["a"] = await run_requests(
        "(a)", lambda p: one_colocated(engine, p, args.max_tokens), prompts, deadline)
    await shutdown_actor(engine)


def count_log_lines(session_dir: str | None, needles: dict[str, str | None]) -> dict[str, int]:
    """How often raypd's connector logged each message in this Ray session's worker logs."""
    counts = {k: 0 for k, v in needles.items() if v}
    if not session_dir:
        return counts
    for f in Path(session_dir, "logs").glob("worker-*.err"):
        try:
            text = f.read_text(errors="replace")
        except OSError:
            continue
        for k, v in needles.items():
            if v:
                counts[k] += sum(line.count(v) for line in text.splitlines() if "raypd" in line)
    return counts


async def wait_released(prefill: Any, since: float, limit_s: float) -> float | None:
    """Seconds from `since` until the prefill engine holds no blocks (its leases were released)."""
    while True:
        st = await prefill.stats.remote()
        now = time.monotonic()
        if st["num_blocks"] and st["free_blocks"] == st["num_blocks"]:
            return round(now - since, 2)
        if now - since > limit_s:
            return None
        await asyncio.sleep(0.25)


async def shutdown_actor(handle: Any) -> None:
    import ray

    try:
        await asyncio.wait_for(handle.shutdown.remote(), 60)
    except Exception as exc:  # noqa: BLE001
        log(f"engine shutdown: {exc!r}")
    ray.kill(handle)


async def phase_raypd(args, prompts, warm, results, cleanup, geom) -> None:
    import ray

    from actors.coordinator import COORDINATOR_NAME, start_coordinator
    from actors.engine import EngineActor, engine_actor_options
    from actors.engine_config import EngineConfig

    coordinator = start_coordinator(check_interval_s=0.5, ping_timeout_s=5.0)
    cleanup.append(("actor", coordinator))
    await coordinator.ping.remote()
    handles = {}
    for role, bind in (("prefill", "0"), ("decode", "1")):
        cfg = EngineConfig(role=role, backend="vllm", engine_id=f"bench-{role}", model=args.model,
                           max_model_len=args.max_model_len, kv_cache_space_gib=args.kv_cache_gib, cpu_bind=bind,
                           enable_prefix_caching=False, num_cpus=0, lease_ttl_s=args.lease_ttl_s, read_timeout_s=10)
        opts = {k: v for k, v in engine_actor_options(cfg).items() if v is not None}
        handles[role] = ray.remote(EngineActor).options(**opts).remote(cfg.model_dump(), COORDINATOR_NAME)
        cleanup.append(("actor", handles[role]))
    t0 = time.monotonic()
    await asyncio.wait_for(asyncio.gather(*(h.start.remote() for h in handles.values())), args.start_timeout_s)
    results["startup_s"]["b"] = time.monotonic() - t0
    log(f"(b) raypd prefill + decode engines up in {results['startup_s']['b']:.0f} s")
    P, D = handles["prefill"], handles["decode"]
    pids = {role: await actor_pid(h) for role, h in handles.items()}
    for p in warm:
        s = await one_raypd(P, D, p, args.max_tokens, geom)
        if not s["ok"]:
            log(f"(b) warm-up request failed: {s['error']}")
    t_end = time.monotonic()

    async def released() -> None:
        results["lease_release_after_warmup_s"] = await wait_released(P, t_end, args.lease_ttl_s + 15)

    await idle_windows("b", pids, args, t_end, results, wait_settled=released)
    deadline = time.monotonic() + args.phase_budget_s
    results["samples"]["b"] = await run_requests(
        "(b)", lambda p: one_raypd(P, D, p, args.max_tokens, geom), prompts, deadline)
    results["lease_release_after_last_request_s"] = await wait_released(P, time.monotonic(), args.lease_ttl_s + 15)
    log(f"(b) prefill blocks all free {results['lease_release_after_last_request_s']} s after the last request")
    results["engine_stats"]["b"] = {role: await h.stats.remote() for role, h in handles.items()}
    results["raypd_log_counts"] = count_log_lines(results.get("ray_session_dir"), {
        "leases_expired_without_readers": "leases expired without readers",
        "kv_pull_failed": "KV pull of"})
    n_b = sum(len(v) for v in results["samples"]["b"].values()) + len(warm)
    results["raypd_log_counts"]["pd_requests"] = n_b
    log(f"(b) raypd worker logs: {results['raypd_log_counts']}")
    for h in (D, P):
        await shutdown_actor(h)
    ray.kill(coordinator)


async def phase_vllm(args, prompts, warm, results, cleanup, model_path: str) -> None:
    import httpx

    log_dir = Path(tempfile.mkdtemp(prefix="raypd-bench-vllm-"))
    results["vllm_logs"] = str(log_dir)
    servers = {}
    for role, bind in (("prefill", "0"), ("decode", "1")):
        servers[role] = ApiServer(role, model_path, free_port(), free_port(), bind, args, log_dir)
        cleanup.append(("server", servers[role]))
    results["vllm_commands"] = {r: " ".join(shlex.quote(c) for c in s.cmd) for r, s in servers.items()}
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout_s)) as client:
        t0 = time.monotonic()
        deadline = t0 + args.start_timeout_s
        await asyncio.gather(*(s.wait_ready(client, deadline) for s in servers.values()))
        results["startup_s"]["c"] = time.monotonic() - t0
        log(f"(c) vLLM API servers up in {results['startup_s']['c']:.0f} s")
        P, D = servers["prefill"], servers["decode"]
        for p in warm:
            s = await one_vllm_pd(client, P.url, D.url, "smollm2", p, args.max_tokens)
            if not s["ok"]:
                log(f"(c) warm-up request failed: {s['error']}")
        await idle_windows("c", {r: s.proc.pid for r, s in servers.items()}, args, time.monotonic(), results)
        deadline = time.monotonic() + args.phase_budget_s
        results["samples"]["c"] = await run_requests(
            "(c)", lambda p: one_vllm_pd(client, P.url, D.url, "smollm2", p, args.max_tokens), prompts, deadline,
            metrics=lambda: nixl_metrics(client, D.url))
    for s in servers.values():
        left = await asyncio.to_thread(s.stop)
        if left:
            results.setdefault("leftover_pids", []).extend(left)


# ------------------------------------------------------------------ report
def build_rows(results: dict, lengths: list[int]) -> list[dict]:
    rows = []
    ref_tokens: dict[int, dict[int, list]] = {}
    for n in lengths:
        ref_tokens[n] = {s["idx"]: s["tokens"] for s in results["samples"].get("a", {}).get(n, [])
                         if s.get("ok")}
    for n in lengths:
        row: dict[str, Any] = {"prompt_tokens": n}
        for k in SETUPS:
            samples = results["samples"].get(k, {}).get(n, [])
            summ = summarize(samples)
            if k != "a" and ref_tokens.get(n):
                pairs = [(s["tokens"], ref_tokens[n][s["idx"]]) for s in samples
                         if s.get("ok") and s["idx"] in ref_tokens[n]]
                same = sum(1 for got, want in pairs if got == want)
                summ["tokens_equal_to_a"] = f"{same}/{len(pairs)}"
            deltas = [s["metrics_delta"] for s in samples if s.get("ok") and "metrics_delta" in s]
            if deltas:  # vLLM's own transfer metrics, scraped around each request
                times = [d["nixl_xfer_time_seconds_sum"] for d in deltas if d.get("nixl_xfer_time_seconds_count")]
                nbytes = [d["nixl_bytes_transferred_sum"] for d in deltas if d.get("nixl_bytes_transferred_count")]
                summ["kv_xfer_time_median_s"] = med(times) if times else None
                summ["kv_bytes_median"] = med(nbytes) if nbytes else None
                summ["nixl_failed_transfers"] = sum(d.get("nixl_num_failed_transfers_total", 0.0) for d in deltas)
            row[k] = summ
        a_ttft = row["a"]["ttft_median_s"]
        for k in ("b", "c"):
            row[f"ttft_ratio_{k}_over_a"] = row[k]["ttft_median_s"] / a_ttft if a_ttft else float("nan")
        row["ttft_ratio_b_over_c"] = (row["b"]["ttft_median_s"] / row["c"]["ttft_median_s"]
                                      if row["c"]["ttft_median_s"] else float("nan"))
        rows.append(row)
    return rows


def fmt_ms(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x * 1e3:.0f}"


def fmt_mb(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x / 2**20:.1f}"


def table(res: dict) -> str:
    rows = res["rows"]
    out = [f"SmolLM2-135M-Instruct fp32, enforce_eager, 1 core per engine, greedy, max_tokens {res['settings']['max_tokens']},"
           f" prefix caching off; sequential requests; medians (ms)"]
    hdr = (f"{'prompt':>6} {'set-up':<34} {'n':>3} {'TTFT p50':>8} {'p90':>6} {'ITL p50':>7} {'tok1->2':>7} "
           f"{'P req':>6} {'D 1st':>6} {'KV MiB':>7} {'xfer ms':>7} {'same tok':>8}")
    out += [hdr, "-" * len(hdr)]
    for r in rows:
        for k in SETUPS:
            s = r[k]
            kv = s.get("kv_bytes_median")
            out.append(f"{r['prompt_tokens']:>6} {NAMES[k]:<34} {s['ok']:>3} {fmt_ms(s['ttft_median_s']):>8} "
                       f"{fmt_ms(s['ttft_p90_s']):>6} {fmt_ms(s['itl_median_s']):>7} "
                       f"{fmt_ms(s['first_gap_median_s']):>7} {fmt_ms(s.get('prefill_s_median')):>6} "
                       f"{fmt_ms(s.get('decode_ttft_median')):>6} "
                       f"{fmt_mb(kv):>7} {fmt_ms(s.get('kv_xfer_time_median_s')):>7} "
                       f"{s.get('tokens_equal_to_a', 'ref'):>8}")
        out.append(f"{'':>6} TTFT ratio (b)/(a) = {r['ttft_ratio_b_over_a']:.2f} (goal <= 1.15), "
                   f"(c)/(a) = {r['ttft_ratio_c_over_a']:.2f}, (b)/(c) = {r['ttft_ratio_b_over_c']:.2f} (goal < 1)")
    out.append("")
    st = res["settings"]
    out.append(f"Idle CPU, % of one core, process tree (EngineActor / API server + all children), {st['idle_s']:.0f} s"
               f" windows: 'after' starts {st['settle_s']:.0f} s after the warm-up requests, 'settled' "
               f"{st['settled_after_s']:.0f} s after them at the earliest ((b): and 2 s after the prefill engine freed its blocks):")
    out.append(f"  {'set-up':<34} {'engine':<8} {'after':>7} {'settled':>8}  goal < 2 %   settled, by process")
    for k in SETUPS:
        for eng, v in (res["idle"].get(k) or {}).items():
            a = (res.get("idle_after_warmup", {}).get(k) or {}).get(eng, {}).get("cpu_pct_of_one_core", float("nan"))
            parts = ", ".join(f"{p['name']} {p['cpu_pct']} (cpus {p['affinity']})" for p in v["processes"]
                              if p["cpu_pct"] > 0)
            verdict = "ok" if v["cpu_pct_of_one_core"] < 2 else "ABOVE"
            out.append(f"  {NAMES[k]:<34} {eng:<8} {a:>7.1f} {v['cpu_pct_of_one_core']:>8.1f}  {verdict:<10}   {parts}")
    if "lease_release_after_last_request_s" in res:
        out.append(f"  (b) prefill engine held KV blocks (and kept stepping) until "
                   f"{res.get('lease_release_after_warmup_s')} s after the warm-up requests and "
                   f"{res.get('lease_release_after_last_request_s')} s after the last measured request"
                   f" (None: still held at the end of the wait)")
    if res.get("raypd_log_counts"):
        c = res["raypd_log_counts"]
        out.append(f"  (b) raypd connector log: {c.get('leases_expired_without_readers')} of {c.get('pd_requests')}"
                   f" P/D requests ended with 'leases expired without readers' (their blocks were freed by the"
                   f" lease TTL, not by the decode's notice); {c.get('kv_pull_failed')} failed pulls")
    out.append("")
    out.append("Columns: TTFT = request sent -> first token at the client ((b): prefill() returned its token; "
               "(c): first streamed token of the decode request, as behind vLLM's toy proxy); ITL = median gap "
               "between streamed tokens after the 2nd; tok1->2 = gap between the 1st and 2nd token ((b): KV pull "
               "+ first decode step); P req = the prefill request's round trip; D 1st = decode request sent -> its "
               "first token ((b), (c): includes the KV pull); KV MiB = KV moved per request ((b): blocks x layers x block bytes from the transfer "
               "params; (c): vLLM's nixl_bytes_transferred); xfer ms = vLLM's nixl_xfer_time_seconds per request "
               "(raypd's engines do not report a pull time); same tok = generated token ids equal to (a)'s.")
    st = res["startup_s"]
    out.append("Start-up: " + ", ".join(f"{k} {v:.0f} s" for k, v in st.items()) +
               f"; host {res['host']['cpus']} CPUs, load average before {res['host']['loadavg_before'][0]:.1f},"
               f" after {res['host']['loadavg_after'][0]:.1f} (shared machine, other jobs ran); wall {res['wall_s']:.0f} s")
    return "\n".join(out)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    xs = [r["prompt_tokens"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for k, m in zip(SETUPS, "osv"):
        axes[0].plot(xs, [r[k]["ttft_median_s"] * 1e3 for r in rows], marker=m, label=NAMES[k])
        axes[1].plot(xs, [r[k]["itl_median_s"] * 1e3 for r in rows], marker=m, label=NAMES[k])
    axes[0].set_title("TTFT median (ms, log scale)")
    axes[0].set_yscale("log")
    axes[1].set_title("inter-token latency median (ms)")
    for ax in axes[:2]:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    labels, vals, vals_after = [], [], []
    for k in SETUPS:
        for eng, v in (res["idle"].get(k) or {}).items():
            labels.append(f"{k}:{eng}")
            vals.append(v["cpu_pct_of_one_core"])
            vals_after.append((res.get("idle_after_warmup", {}).get(k) or {}).get(eng, {}).get(
                "cpu_pct_of_one_core", 0.0))
    xs_bar = list(range(len(labels)))
    axes[2].bar([x - 0.2 for x in xs_bar], vals_after, width=0.4, label="right after warm-up")
    axes[2].bar([x + 0.2 for x in xs_bar], vals, width=0.4, label="settled")
    axes[2].set_xticks(xs_bar, labels, fontsize=7)
    axes[2].axhline(2.0, color="red", linestyle="--", label="2 % goal")
    axes[2].set_title("idle CPU (% of one core)")
    axes[2].legend(fontsize=7)
    fig.suptitle("SmolLM2-135M fp32, 1 core per engine: colocated vs raypd P/D vs vLLM NixlConnector P/D")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# ------------------------------------------------------------------ main
async def main_async(args: argparse.Namespace, results: dict, cleanup: list) -> None:
    import ray

    from actors.models import resolve_model

    lengths = [int(x) for x in args.lengths.split(",")]
    reps = [int(x) for x in args.reps.split(",")]
    if len(reps) == 1:
        reps = reps * len(lengths)
    model_path = str(await asyncio.to_thread(resolve_model, args.model))
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    geom = {"layers": cfg["num_hidden_layers"], "bytes_per_token_layer": cfg["num_key_value_heads"] * 2 * head * 4}
    results["model"] = {"path": model_path, "layers": cfg["num_hidden_layers"],
                        "kv_heads": cfg["num_key_value_heads"], "head_dim": head}
    prompts = make_prompts(lengths, reps, args.seed, cfg["vocab_size"])
    warm = make_prompts([min(lengths)], [2], args.seed + 1, cfg["vocab_size"])[min(lengths)]
    setups = [s for s in args.setups.split(",") if s]
    if {"a", "b"} & set(setups):
        ctx = ray.init(num_cpus=4, include_dashboard=False, _temp_dir=RAY_TEMP, log_to_driver=False,
                       namespace="raypd")
        cleanup.append(("ray", None))
        results["ray_session_dir"] = ctx.address_info.get("session_dir")
    if "a" in setups:
        await phase_colocated(args, prompts, warm, results, cleanup)
    if "b" in setups:
        await phase_raypd(args, prompts, warm, results, cleanup, geom)
    if "c" in setups:
        await phase_vllm(args, prompts, warm, results, cleanup, model_path)
    results["rows"] = build_rows(results, lengths)


def do_cleanup(cleanup: list, results: dict) -> None:
    for kind, obj in reversed(cleanup):
        try:
            if kind == "server":
                if obj.proc.poll() is None or any(alive(p) for p in tree(obj.proc.pid)):
                    left = obj.stop()
                    if left:
                        results.setdefault("leftover_pids", []).extend(left)
            elif kind == "actor":
                import ray

                if ray.is_initialized():
                    try:
                        ray.kill(obj)
                    except Exception:  # noqa: BLE001 - already gone
                        pass
            elif kind == "ray":
                import ray

                if ray.is_initialized():
                    ray.shutdown()
        except Exception as exc:  # noqa: BLE001 - keep cleaning
            log(f"cleanup of {kind}: {exc!r}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="raypd model spec (default: the embedded SmolLM2)")
    p.add_argument("--lengths", default="128,512,2048", help="prompt lengths in tokens")
    p.add_argument("--reps", default="6,4,3", help="requests per prompt length (one value or one per length)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request")
    p.add_argument("--max-model-len", type=int, default=2304)
    p.add_argument("--kv-cache-gib", type=int, default=1)
    p.add_argument("--setups", default="a,b,c", help="which set-ups to run, in order")
    p.add_argument("--idle-s", type=float, default=10.0, help="idle CPU sampling window")
    p.add_argument("--settle-s", type=float, default=1.0,
                   help="idle window 1 ('after') starts this long after the warm-up requests")
    p.add_argument("--settled-after-s", type=float, default=25.0,
                   help="idle window 2 ('settled') starts this long after the warm-up requests (at the earliest)")
    p.add_argument("--lease-ttl-s", type=float, default=30.0, help="(b): the engines' lease_ttl_s (EngineConfig default)")
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--phase-budget-s", type=float, default=150.0, help="max seconds of requests per set-up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the results JSON here (and a .txt table next to it)")
    p.add_argument("--plot", default=None, help="write a PNG plot here")
    args = p.parse_args(argv)

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    started = time.monotonic()
    results: dict[str, Any] = {
        "benchmark": "pd_vs_vllm",
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [sys.executable.replace(str(ROOT) + "/", ""), *sys.argv]),
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                 "loadavg_before": os.getloadavg()},
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "plot")},
        "startup_s": {}, "idle": {}, "idle_after_warmup": {}, "samples": {}, "engine_stats": {},
        "seen_pids": [],
    }
    cleanup: list = []
    rc = 0
    try:
        asyncio.run(main_async(args, results, cleanup))
    except BaseException as exc:  # noqa: BLE001 - report, clean up, exit non-zero
        log(f"benchmark aborted: {exc!r}")
        results["aborted"] = repr(exc)
        rc = 1
    finally:
        do_cleanup(cleanup, results)
        time.sleep(2)
        left = sorted({p for p in results["seen_pids"] + results.get("leftover_pids", []) if alive(p)})
        results["leftover_pids"] = left
        log("cleanup: every engine process seen is gone" if not left else f"cleanup: STILL ALIVE: {left}")
    results["host"]["loadavg_after"] = os.getloadavg()
    results["wall_s"] = time.monotonic() - started
    if "rows" not in results:
        lengths = [int(x) for x in args.lengths.split(",")]
        try:
            results["rows"] = build_rows(results, lengths)
        except Exception:  # noqa: BLE001
            results["rows"] = []
    text = table(results) if results["rows"] else "no results"
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2, default=str) + "\n")
        Path(args.out).with_suffix(".txt").write_text(f"# {results['date']}\n# command: {results['command']}\n{text}\n")
        print(f"results written to {args.out} (+ .txt)")
    if args.plot and results["rows"]:
        plot(results, args.plot)
        print(f"plot written to {args.plot}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
