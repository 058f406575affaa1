#!/usr/bin/env python
"""raypd P/D against colocated vLLM, vLLM's NixlConnector P/D and Ray Serve LLM's P/D, one run, one client.

  flock /tmp/raypd-cpu.lock .venv/bin/python benchmarks/pd_vs_vllm.py                   # groups A,B,E,E0,AP, ~49 min
  flock /tmp/raypd-cpu.lock .venv/bin/python benchmarks/pd_vs_vllm.py --profile anchors  # + C,DC,D (1 round), ~70
  flock /tmp/raypd-cpu.lock .venv/bin/python benchmarks/pd_vs_vllm.py --profile stack    # A,E0,E (issue 30: the stack), ~30 min
  flock /tmp/raypd-cpu.lock .venv/bin/python benchmarks/pd_vs_vllm.py --profile plan     # A,AP,EP (issue 28: the planner's shape)
  flock /tmp/raypd-cpu.lock .venv/bin/python benchmarks/pd_vs_vllm.py --quick            # development, ~9 min
  .venv/bin/python benchmarks/pd_vs_vllm.py [--quick] --plan   # the planned duration; starts nothing

Set-ups (benchmarks/pdbench/setups.py; all SmolLM2-135M-Instruct, float32, block
size 128, prefix caching on, max_model_len 2304, 1 GiB KV cache and one core per
engine; vLLM's own set-ups max_num_seqs 128, max_num_batched_tokens 2048):
  (a)  vLLM's OpenAI server, one engine (core 0)                                  group A
  (a2) two such servers (cores 0, 1) behind a least-loaded balancer               group A
  (a') one such server computing on both cores (the CPU twin of TP 2 colocated)   group AP
  (b)  `raypd up`: 1 prefill (core 0) + 1 decode (core 1), placement disaggregate group B
  (e)  `raypd up` as shipped: 2 engines of role both (cores 0, 1), placement slo  group E
       (raypd picks these engines' max_num_batched_tokens; the table prints what they run)
  (e0) (e) with placement that never disaggregates (pdbench/colocated.py): the stack's cost    group E0
  (ep) `raypd up` with the shape `raypd config --plan` picks for this load (pdbench/planned.py)  group EP
  (c)  vLLM NixlConnector P/D: two vLLM OpenAI servers + vLLM's documented proxy logic  group C
  (d)  Ray Serve LLM `build_pd_openai_app` (NixlConnector), as shipped; (dc) its twin `build_openai_app`
Every request goes through the official `openai` client, streaming over HTTP
(pdbench/client.py). Set-ups run one at a time, in the order of --groups, then
reversed, over --rounds rounds (a group adjacent to itself is not restarted; the
groups of --one-round-groups run in round 1 only). The planned duration is printed first.
Per group and round: start, confine each vLLM worker to its core, warm up, an
idle CPU window, the low-load requests, then the open-loop Poisson load (rates
ascending in odd rounds, descending in even ones). Every phase records the
host's load average before/after and the CPU used by processes outside the
set-up; for raypd's set-ups also the front's fault counters (pdbench/faults.py): no fault is
injected, so a hang kill in any phase fails the run (exit status 3, after the results are
written). Results: --out JSON (+ .txt table) and --plot PNG, written only here (defaults: pdbench/run_args.py's OUTPUTS;
--plan prints the schedule and planned duration and starts nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import shlex
import signal
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

from serving.bench.provenance import git_state  # noqa: E402
from pdbench import client, faults, planned, plot, procs, report, run_args, setups, summary  # noqa: E402
from pdbench.group import Group, SetupError  # noqa: E402
from pdbench.raypd_up import RaypdUp  # noqa: E402
from pdbench.schedule import LOAD_SETUP, LOW_SETUP, make_schedule, plan, plan_line  # noqa: E402,F401

CHECK_FAILED = 3  # exit status: the benchmark's own check failed (a hang kill with no fault injected)
ENGINE_SETTINGS = dict(served_model_name="smollm2", dtype="float32", max_model_len=2304, block_size=128,
                       enable_prefix_caching=True, max_num_seqs=128, max_num_batched_tokens=2048,
                       kv_cache_gib=1, raypd_config="benchmarks/configs/pd_1p1d.yaml",
                       raypd_default_config="benchmarks/configs/pd_default.yaml")
SMOLLM2_VOCAB = 49152  # --plan only (no model read): the streams' timing does not depend on it


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Run:
    """One invocation: the schedule, the phase log and every record."""

    def __init__(self, args: argparse.Namespace, res: dict):
        self.args, self.res = args, res
        self.lengths = [int(x) for x in args.lengths.split(",")]
        self.rates = [float(x) for x in args.rates.split(",")]
        self.mix = {int(k): float(v) for k, v in (kv.split(":") for kv in args.mix.split(","))}
        self.group: Group | None = None
        self.trail: faults.FaultTrail | None = None  # the raypd group's fault counters, per phase
        self.run_dir = Path(args.run_dir or f"/tmp/pdbench-{time.strftime('%Y%m%d-%H%M%S')}")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        res["run_dir"] = str(self.run_dir)

    # ------------------------------------------------------------ phases
    def phase(self, rnd: int, key: str, kind: str, detail: str, fn, cpu_out: dict | None = None):
        """Run `fn()` as one recorded phase: host load before/after, CPU of everything else
        (and, into `cpu_out`, the CPU seconds of the set-up's processes by kind)."""
        before = procs.host_state()
        ours = (self.group.all_pids() if self.group else []) + [os.getpid()]
        win = procs.CpuWindow(ours)
        t0 = time.time()
        try:
            return fn()
        finally:
            cpu = win.close(self.group.all_pids() if self.group else [])
            if cpu_out is not None and self.group is not None:
                cpu_out.update(procs.cpu_seconds_by_kind(self.group.all_pids(), cpu["per_pid_pct"], cpu["wall_s"]))
            after = procs.host_state()
            peak = max(before["loadavg"][0], after["loadavg"][0])
            self.res["phases"].append({
                "round": rnd, "group": key, "kind": kind, "detail": detail, "start": round(t0, 1),
                "wall_s": round(cpu["wall_s"], 1), "loadavg_before": before["loadavg"],
                "loadavg_after": after["loadavg"], "others_cpu_pct": round(cpu["others_pct"], 1), "others_top": cpu["others_top"],
                "setup_cpu_pct": round(cpu["ours_pct"], 1), "load_above_cores": peak > procs.NCPU})
            log(f"  {kind} {detail}: {cpu['wall_s']:.0f}s, load {before['loadavg'][0]:.1f}->"
                f"{after['loadavg'][0]:.1f}, others {cpu['others_pct']:.0f}% of a core {cpu['others_top']}")

    def start_group(self, rnd: int, key: str) -> None:
        if self.group is not None and self.group.key == key:
            return
        self.stop_group()
        g = setups.make_group(key, self.settings, self.model_path, self.run_dir)
        self.group = g
        t0 = time.monotonic()
        log(f"round {rnd}: starting {key}")
        self.phase(rnd, key, "start", key, g.start)
        self.res["startup_s"].setdefault(key, []).append(round(time.monotonic() - t0, 1))
        self.res["seen_pids"] += g.all_pids()
        if isinstance(g, RaypdUp) and g.plan_table:
            self.res.setdefault("plan", {})["table"] = g.plan_table
        if isinstance(g, RaypdUp):
            self.trail = faults.FaultTrail(self.res["faults"].setdefault(g.setup, []))
            self.read_faults(rnd, "start")

    def stop_group(self) -> None:
        if self.trail is not None:  # a kill decided after the last phase still counts
            if self.trail.last_phase_missed():
                time.sleep(faults.KILL_VERDICT_S)
            self.read_faults(self.trail.round, "after the last phase")
            self.trail = None
        g, self.group = self.group, None
        if g is None:
            return
        self.res["engine_configs"].setdefault(g.key, report.engine_config_lines(g))
        if isinstance(g, RaypdUp):
            self.res["raypd_engines"].setdefault(g.key, g.engine_settings())
        left = g.stop()
        if left:
            self.res["leftover_pids"] += left
            log(f"  {g.key}: STILL ALIVE after stop: {left}")

    def read_faults(self, rnd: int, phase: str) -> None:
        """The raypd front's fault counters now, as the end of `phase` (pdbench/faults.py)."""
        if self.trail is not None and isinstance(self.group, RaypdUp):
            e = self.trail.record(rnd, phase, self.group.fault_counters())
            if e["counts"].get(faults.KILLS) or e["counts"].get(faults.MISSES) or e["errors"]:
                log(f"  faults in {phase}: {e['counts']} {e['errors'][-1:]}")

    def pin(self, key: str, when: str) -> None:
        pinned = self.group.pin()
        self.res["pinning"].setdefault(key, []).append({"when": when, "workers": pinned})

    def idle(self, rnd: int, key: str) -> None:
        g = self.group
        if isinstance(g, RaypdUp):
            g.start_idle_reference()
        time.sleep(self.args.settle_s)

        def window():
            pids = g.idle_pids()
            win = procs.CpuWindow(pids)
            time.sleep(self.args.idle_s)
            cpu = win.close()
            binds = g.binds(pids)
            return [{"pid": p, "ppid": procs.ppid(p), "name": procs.proc_name(p), "bind": binds.get(p),
                     "cpu_pct": round(cpu["per_pid_pct"][p], 3), "affinity": procs.thread_affinities(p)}
                    for p in pids if p in cpu["per_pid_pct"]]

        rows = self.phase(rnd, key, "idle", key, window)
        self.res["idle"].setdefault(key, []).append({"round": rnd, "wall_s": self.args.idle_s, "processes": rows})
        if isinstance(g, RaypdUp):
            g.stop_idle_reference()

    def warm_up(self, key: str) -> None:
        reqs = client.low_load_requests(self.args.seed + 1000, 0, [128, 512], 1, 8, self.vocab)
        for setup, url in self.group.endpoints.items():
            recs = asyncio.run(client.low_load(url, self.settings["served_model_name"], reqs + reqs[:1],
                                               self.args.request_timeout_s))
            bad = [r.error for r in recs if not r.ok]
            if bad:
                raise SetupError(f"{setup}: warm-up failed: {bad[0]}")

    def low_load(self, rnd: int, key: str) -> None:
        setup = LOW_SETUP.get(key)
        if setup not in self.setups:
            return
        reqs = client.low_load_requests(self.args.seed, rnd, self.lengths, self.args.reps,
                                        self.args.low_max_tokens, self.vocab)
        before = self.decisions()
        recs = self.phase(rnd, key, "low", setup, lambda: asyncio.run(client.low_load(
            self.group.endpoints[setup], self.settings["served_model_name"], reqs, self.args.request_timeout_s,
            lambda rec: self.read_faults(rnd, f"low {rec.length}"))))
        if before is not None:
            self.res["low_decisions"].setdefault(setup, []).append(self.decisions_since(before))
        store = self.res["low"].setdefault(setup, {})
        for r in recs:
            store.setdefault(str(r.length), []).append({"round": rnd, **r.to_json()})

    def load(self, rnd: int, key: str) -> None:
        setup = LOAD_SETUP.get(key)
        if setup not in self.setups:
            return
        rates = self.rates if rnd % 2 else list(reversed(self.rates))
        for rate in rates:
            reqs = client.poisson_requests(self.args.seed, rnd, rate, self.args.load_requests, self.mix,
                                           self.args.load_max_tokens, self.vocab)
            cpu: dict = {}
            before = self.decisions()
            recs, duration = self.phase(rnd, key, "load", f"{setup}@{rate}", lambda: asyncio.run(client.poisson(
                self.group.endpoints[setup], self.settings["served_model_name"], reqs,
                self.args.request_timeout_s, self.args.drain_s)), cpu_out=cpu)
            cpu["tokens"] = sum(r.completion_tokens or 0 for r in recs if r.ok)
            self.read_faults(rnd, f"load {rate}")
            run = {"round": rnd, "duration_s": duration, "cpu": cpu, "records": [r.to_json() for r in recs]}
            if before is not None:
                run["decisions"] = self.decisions_since(before)
                log(f"  {setup}@{rate} placement: {run['decisions']}")
            self.res["load"].setdefault(setup, {}).setdefault(str(rate), []).append(run)

    def decisions(self) -> dict | None:
        """raypd's placement counters now (None for a set-up that is not raypd)."""
        return self.group.decisions() if isinstance(self.group, RaypdUp) else None

    def decisions_since(self, before: dict) -> dict:
        now = self.decisions() or {}
        if "error" in now or "error" in before:
            return {"error": now.get("error") or before.get("error")}
        return {k: v - before.get(k, 0) for k, v in now.items() if v - before.get(k, 0)}

    # ------------------------------------------------------------ main
    def run(self) -> None:
        from actors.models.local import resolve_model

        self.model_path = str(resolve_model("smollm2"))
        cfg = json.loads((Path(self.model_path) / "config.json").read_text())
        self.vocab = int(cfg["vocab_size"])
        self.settings = dict(ENGINE_SETTINGS, start_timeout_s=self.args.start_timeout_s,
                             load=dict(rates=self.args.rates, mix=self.args.mix, max_tokens=self.args.load_max_tokens))
        self.res["settings"]["engines"] = self.settings
        self.res["model"] = {"path": self.model_path, "layers": cfg["num_hidden_layers"],
                             "kv_heads": cfg["num_key_value_heads"], "vocab": self.vocab}
        self.setups = set(self.args.setups.split(","))
        schedule = make_schedule(self.args)
        self.res["schedule"] = schedule
        self.res["planned"] = plan(self.args, schedule, self.vocab)
        self.res["planned_s"] = self.res["planned"]["total"]
        log(plan_line(self.res["planned"], schedule))
        if "ep" in self.setups:  # the planner's prediction for the very requests the load phases send
            streams = {(rnd, rate): client.poisson_requests(self.args.seed, rnd, rate, self.args.load_requests, self.mix,
                                                            self.args.load_max_tokens, self.vocab)
                       for rnd in range(1, self.args.rounds + 1) for rate in self.rates}
            base = ROOT / self.settings["raypd_default_config"]
            self.res["plan"] = planned.predicted(base, streams, self.args.mix, self.args.load_max_tokens)
            log(f"planner: {self.res['plan']}")
        for rnd, key in schedule:
            self.start_group(rnd, key)
            self.pin(key, f"round {rnd} after start")
            self.phase(rnd, key, "warm-up", key, lambda: self.warm_up(key))
            self.pin(key, f"round {rnd} after warm-up")
            self.idle(rnd, key)
            self.read_faults(rnd, "warm-up, idle")
            self.low_load(rnd, key)
            self.load(rnd, key)
            self.pin(key, f"round {rnd} after the requests")  # records affinities at the end
        self.stop_group()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return run_args.parse_args(argv, __doc__.split("\n\n")[0])


def on_sigterm(signum: int, _frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # unwinds through the cleanup below


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plan:
        schedule = make_schedule(args)
        print(plan_line(plan(args, schedule, SMOLLM2_VOCAB), schedule))
        return 0
    if args.render:
        res = json.loads(Path(args.render).read_text())
        res["summary"] = summary.summarize(res)
        print(report.header(res) + report.table(res))
        if args.plot:
            plot.plot(res, args.plot)
        return CHECK_FAILED if faults.failed(res["summary"]["checks"]) else 0
    missing = run_args.serve_llm_missing(args)
    if missing:  # before anything starts: an anchors run once found out only when it reached (dc)
        print(f"pd_vs_vllm: set-ups (d)/(dc) (Ray Serve LLM) import {', '.join(missing)}: run `make bench-setup` "
              "first", file=sys.stderr)
        return 2
    started = time.monotonic()
    signal.signal(signal.SIGTERM, on_sigterm)
    res: dict = {
        "benchmark": "pd_vs_vllm", "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(a) for a in [os.path.relpath(sys.executable, ROOT), *sys.argv]),
        "git": git_state(ROOT),
        "host": {"cpus": procs.NCPU, "platform": platform.platform(), "python": platform.python_version(),
                 "before": procs.host_state()},
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "plot")},
        "phases": [], "startup_s": {}, "pinning": {}, "engine_configs": {}, "raypd_engines": {}, "idle": {},
        "low": {}, "low_decisions": {}, "load": {}, "faults": {},
        "seen_pids": [], "leftover_pids": [],
    }
    run = Run(args, res)
    rc = 0
    try:
        run.run()
    except BaseException as exc:  # noqa: BLE001 - report, clean up, write what was measured
        log(f"benchmark aborted: {exc!r}")
        res["aborted"] = repr(exc)
        rc = 1
    finally:
        run.stop_group()
        left = sorted({p for p in res["seen_pids"] + res["leftover_pids"] if procs.alive(p)})
        res["leftover_pids"] = left
        log("cleanup: every process started is gone" if not left else f"cleanup: STILL ALIVE: {left}")
    res["host"]["after"] = procs.host_state()
    res["wall_s"] = round(time.monotonic() - started, 1)
    if res.get("planned_s"):
        log(f"wall {res['wall_s'] / 60:.1f} min, planned {res['planned_s'] / 60:.1f} min")
    res["summary"] = summary.summarize(res)
    text = report.table(res)
    print(text)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1, default=str) + "\n")
        out.with_suffix(".txt").write_text(report.header(res) + text + "\n")
        log(f"results written to {out} (+ .txt)")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot.plot(res, args.plot)
        log(f"plot written to {args.plot}")
    if faults.failed(res["summary"]["checks"]):
        log("FAILED: a hang kill with no fault injected (FAULT COUNTERS in the table)")
        rc = rc or CHECK_FAILED
    return rc


if __name__ == "__main__":
    sys.exit(main())
