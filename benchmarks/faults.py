#!/usr/bin/env python
"""One fault schedule for every P/D set-up: the wrong-answer rate and the goodput under each fault.

  flock /tmp/raypd-cpu.lock .venv/bin/python benchmarks/faults.py             # (b), (e), (c); ~20 min
  .venv/bin/python benchmarks/faults.py --plan                                 # the planned duration only
  .venv/bin/python benchmarks/faults.py --render benchmarks/results/faults.json  # re-print the table

Set-ups (pdbench/setups.py, the same as benchmarks/pd_vs_vllm.py: SmolLM2-135M-Instruct, float32,
block size 128, one core per engine): (b) raypd 1P+1D, (e) raypd's default (2 engines of role
both, SLO placement), (c) vLLM NixlConnector P/D (two vLLM OpenAI servers + vLLM's proxy logic).
(d) Ray Serve LLM P/D is not run (the results file says why), nor a P<->D partition (multi-host).

Per set-up: start it, pin its engines to their cores, compute the greedy reference of every prompt
one at a time (batch 1) while healthy, then one phase per fault. A phase is an open-loop stream
(same prompts, same arrival times everywhere; pdbench/fault_client.py) with the fault injected
`--fault-at-s` after its first send:
  decode SIGSTOP   the decode engine's process tree stopped for --stop-s, then SIGCONT
  prefill SIGKILL  the prefill engine's tree killed while pulls are in flight
  decode SIGKILL   the decode engine's tree killed
((e): "decode" = its engine on core 1, "prefill" = its engine on core 0; pdbench/fault_inject.py.)
After a phase raypd is given time to recover (Ray restarts a killed engine); (c) is restarted by
the harness after a kill (nothing in (c) restarts a server). Each request's outcome is right,
wrong, cut, hung or a clean error (pdbench/fault_outcomes.py). Results: --out JSON + .txt table +
--plot PNG, written only here. Exit status 3 when raypd gave a wrong answer, cut a stream or
left a request hung (the benchmark's own check).
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
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

from serving.bench.provenance import git_state  # noqa: E402
from pdbench import fault_client, fault_inject, fault_outcomes, fault_report, fault_ties  # noqa: E402
from pdbench import faults, procs, setups  # noqa: E402

CHECK_FAILED = 3
GROUP = {"b": "B", "e": "E", "c": "C"}
RAYPD = {"b", "e"}
# (name, role, action)
PHASES = (("decode SIGSTOP", "decode", "stop"), ("prefill SIGKILL", "prefill", "kill"),
          ("decode SIGKILL", "decode", "kill"))
STOP_PHASES = {p for p, _, a in PHASES if a == "stop"}
ENGINE_SETTINGS = dict(served_model_name="smollm2", dtype="float32", max_model_len=2304, block_size=128,
                       enable_prefix_caching=True, max_num_seqs=128, max_num_batched_tokens=2048,
                       kv_cache_gib=1, raypd_config="benchmarks/configs/pd_1p1d.yaml",
                       raypd_default_config="benchmarks/configs/pd_default.yaml")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Injector(threading.Thread):
    """Signals the target tree at t0 + at_s (SIGKILL, or SIGSTOP then SIGCONT after stop_s)."""

    def __init__(self, pids: list[int], action: str, t0: float, at_s: float, stop_s: float):
        super().__init__(daemon=True)
        self.pids, self.action, self.t0, self.at_s, self.stop_s = pids, action, t0, at_s, stop_s
        self.fault_s: float | None = None
        self.until_s: float | None = None
        self.signalled: list[int] = []

    def run(self) -> None:
        time.sleep(max(0.0, self.t0 + self.at_s - time.monotonic()))
        sig = signal.SIGKILL if self.action == "kill" else signal.SIGSTOP
        self.fault_s = round(time.monotonic() - self.t0, 2)
        self.signalled = fault_inject.send(self.pids, sig)
        if self.action == "stop":
            time.sleep(self.stop_s)
            fault_inject.send(self.pids, signal.SIGCONT)
            self.until_s = round(time.monotonic() - self.t0, 2)


class Run:
    def __init__(self, args: argparse.Namespace, res: dict):
        self.args, self.res = args, res
        self.group: setups.Group | None = None
        self.trail: faults.FaultTrail | None = None
        self.run_dir = Path(args.run_dir or f"/tmp/faultbench-{time.strftime('%Y%m%d-%H%M%S')}")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        res["run_dir"] = str(self.run_dir)
        self.started = time.monotonic()

    def budget(self, what: str) -> None:
        """Start nothing new once the run's time budget is spent (what did not run is said so)."""
        if time.monotonic() - self.started > self.args.budget_s:
            raise setups.SetupError(f"time budget ({self.args.budget_s:.0f} s) spent before {what}: not run")

    def start(self, setup: str) -> float:
        t = time.monotonic()
        g = setups.make_group(GROUP[setup], self.settings, self.model_path, self.run_dir)
        self.group = g
        g.start()
        self.res["seen_pids"] += g.all_pids()
        g.pin()
        return round(time.monotonic() - t, 1)

    def stop(self) -> None:
        g, self.group = self.group, None
        if g is not None:
            left = g.stop()
            if left:
                self.res["leftover_pids"] += left
                log(f"  {g.key}: STILL ALIVE after stop: {left}")

    def read_faults(self, phase: str) -> None:
        if self.trail is not None and isinstance(self.group, setups.RaypdUp):
            self.trail.record(1, phase, self.group.fault_counters())

    def run(self) -> None:
        from actors.models.local import resolve_model

        self.model_path = str(resolve_model("smollm2"))
        self.vocab = vocab = int(json.loads((Path(self.model_path) / "config.json").read_text())["vocab_size"])
        a = self.args
        self.settings = dict(ENGINE_SETTINGS, start_timeout_s=a.start_timeout_s)
        self.prompts = fault_client.prompts(a.seed, a.requests, a.prompt_tokens, vocab)
        self.at_s = fault_client.arrivals(a.seed, a.requests, a.rate)
        self.res["arrivals_s"] = self.at_s
        for setup in a.setups.split(","):
            try:
                self.one_setup(setup)
            except Exception as exc:  # noqa: BLE001 - one set-up's failure is its result; the next one runs
                log(f"{setup}: {exc!r}")
                self.res["setup_errors"][setup] = repr(exc)
            finally:
                self.stop()
                self.trail = None

    def one_setup(self, setup: str) -> None:
        a, model = self.args, self.settings["served_model_name"]
        self.budget(f"starting {setup}")
        log(f"{setup}: starting")
        self.res["startup_s"][setup] = self.start(setup)
        url = next(iter(self.group.endpoints.values()))
        if setup in RAYPD:
            self.trail = faults.FaultTrail(self.res["fault_trail"].setdefault(setup, []))
        warm = fault_client.prompts(a.seed + 1, 2, a.prompt_tokens, self.vocab)
        asyncio.run(fault_client.reference(url, model, warm, a.max_tokens, a.limit_s))
        refs = asyncio.run(fault_client.reference(url, model, self.prompts, a.max_tokens, a.limit_s))
        bad = [r for r in refs if not (r.status == 200 and r.done and r.error_event is None)]
        self.res["references"][setup] = [r.text for r in refs]
        took = max((r.end_s or 0.0) for r in refs)
        self.res["reference_summary"][setup] = f"{len(refs) - len(bad)}/{len(refs)} in {took:.0f} s"
        self.read_faults("reference")
        if bad:
            raise setups.SetupError(f"reference failed on the healthy set-up: {bad[0].to_json()}")
        log(f"{setup}: references in {took:.0f} s")
        engines = len(fault_inject.engine_cores(self.group))
        restart = False
        for name, role, action in PHASES:
            self.budget(name)
            info: dict = {}
            self.res["phase_info"].setdefault(setup, {})[name] = info
            if restart:  # (c): nothing restarts a killed server; a fresh set-up for the next fault
                self.stop()
                info["restarted_setup_s"] = self.start(setup)
                url = next(iter(self.group.endpoints.values()))
                restart = False
            before = self.group.decisions() if isinstance(self.group, setups.RaypdUp) else None
            pids = fault_inject.target(self.group, role)
            info["target"] = [f"{p} {procs.proc_name(p)}" for p in pids]
            t0 = time.monotonic() + 0.5
            inj = Injector(pids, action, t0, a.fault_at_s, a.stop_s)
            inj.start()
            log(f"{setup}: {name} (targets {info['target']})")
            streams = asyncio.run(fault_client.open_loop(url, model, self.prompts, self.at_s, a.max_tokens,
                                                          a.limit_s, t0))
            inj.join()
            info["signalled"] = len(inj.signalled)
            fault_s = inj.fault_s if inj.fault_s is not None else a.fault_at_s
            until = inj.until_s if inj.until_s is not None else fault_s + a.kill_window_s
            end = max([s.end_s or 0.0 for s in streams] + [until])
            outs = [fault_outcomes.classify(s, self.res["references"][setup][s.idx]) for s in streams]
            fig = fault_outcomes.aggregate(outs, fault_outcomes.Window(fault_s, until, end))  # the log's (no ties)
            self.res["streams"].setdefault(setup, {})[name] = [s.to_json() for s in streams]
            info["fault_s"], info["until_s"], info["end_s"] = fault_s, until, round(end, 2)
            if isinstance(self.group, setups.RaypdUp):
                gone = set(inj.signalled) if action == "kill" else set()
                info["recovered_s"] = fault_inject.wait_raypd_recovered(self.group, engines, gone, a.recover_s)
                self.group.pin()
                time.sleep(3.0)
                info["at_rest"] = fault_inject.at_rest(self.group)
                now = self.group.decisions()
                if before is not None and "error" not in now and "error" not in before:
                    info["placement"] = {k: v - before.get(k, 0) for k, v in now.items() if v - before.get(k, 0)}
                self.read_faults(name)
                if info["recovered_s"] is None:
                    log(f"{setup}: not recovered within {a.recover_s:.0f} s after {name}")
                    raise setups.SetupError(f"not recovered within {a.recover_s:.0f} s after {name}")
            else:
                info["at_rest"] = fault_inject.at_rest(self.group)
                restart = action == "kill"
            log(f"{setup}: {name}: {fig.counts} goodput {fig.goodput_before}|{fig.goodput_during}|"
                f"{fig.goodput_after} first good {fig.first_good_s} {info.get('at_rest')}")


def fault_counts(res: dict) -> dict:
    return {s: {e["phase"]: e["counts"] for e in entries} for s, entries in res.get("fault_trail", {}).items()}


def judge_ties(res: dict, model_path: str, prompts: list[list[int]]) -> None:
    """res["tie_gaps"][setup][phase][idx]: the top-two gap at the first differing token of every
    complete answer whose text differs from its reference (pdbench/fault_ties.py)."""
    from pdbench.fault_ties import TieJudge

    judge: TieJudge | None = None
    for setup, phases in res["streams"].items():
        refs = res["references"][setup]
        for phase, streams in phases.items():
            for d in streams:
                s = fault_outcomes.Stream(**d)
                if fault_outcomes.complete(s) and s.text != refs[s.idx]:
                    judge = judge or TieJudge(model_path)
                    gap = judge.gap(prompts[s.idx], refs[s.idx], s.text)
                    res["tie_gaps"].setdefault(setup, {}).setdefault(phase, {})[str(s.idx)] = gap


def figures(res: dict) -> dict[str, dict[str, fault_outcomes.PhaseFigures]]:
    out: dict[str, dict[str, fault_outcomes.PhaseFigures]] = {}
    for setup, phases in res["streams"].items():
        refs = res["references"][setup]
        for phase, streams in phases.items():
            gaps = res.get("tie_gaps", {}).get(setup, {}).get(phase, {})
            info = res["phase_info"].get(setup, {}).get(phase, {})
            if "end_s" not in info:
                continue
            outs = [fault_outcomes.classify(s, refs[s.idx], gaps.get(str(s.idx)), fault_ties.NEAR_TIE_NATS)
                    for s in (fault_outcomes.Stream(**d) for d in streams)]
            w = fault_outcomes.Window(info["fault_s"], info["until_s"], info["end_s"])
            out.setdefault(setup, {})[phase] = fault_outcomes.aggregate(outs, w)
    return out


def finish(res: dict) -> list[str]:
    """The per-phase figures, the table's summary fields and the benchmark's check (raypd only)."""
    res["fault_counts"] = fault_counts(res)
    figs = figures(res)
    res["figures"] = {s: {p: f.to_json() for p, f in ps.items()} for s, ps in figs.items()}
    check = fault_outcomes.bad_of_raypd(figs, RAYPD)
    for s in RAYPD & set(res["setups"]):
        if s in res.get("setup_errors", {}):
            check.append(f"{s}: {res['setup_errors'][s]}")
    notes = [f"{s}: {fault_outcomes.false_kills(e, STOP_PHASES):.0f} false kills"
             for s, e in res.get("fault_trail", {}).items()]
    res["check"] = check
    res["false_kills"] = notes
    return check


def plan_s(a: argparse.Namespace) -> float:
    """A rough duration: per set-up a start, the references, per phase its arrivals + a drain + recovery."""
    arrivals = fault_client.arrivals(a.seed, a.requests, a.rate)[-1]
    per_phase = arrivals + 25 + 45
    n = len(a.setups.split(","))
    return n * (60 + 2 * a.requests + len(PHASES) * per_phase) + ("c" in a.setups) * 2 * 50


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setups", default="b,e,c", help="b (raypd 1P+1D), e (raypd default), c (vLLM NixlConnector)")
    p.add_argument("--requests", type=int, default=12, help="requests per phase")
    p.add_argument("--rate", type=float, default=0.3, help="open-loop arrival rate (req/s)")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--fault-at-s", type=float, default=6.0, help="the fault, this long after the phase starts")
    p.add_argument("--stop-s", type=float, default=30.0, help="SIGSTOP -> SIGCONT")
    p.add_argument("--kill-window-s", type=float, default=30.0, help="the 'during' window after a SIGKILL")
    p.add_argument("--limit-s", type=float, default=120.0, help="a request without an outcome by then is hung")
    p.add_argument("--recover-s", type=float, default=240.0, help="raypd: wait this long for a killed engine")
    p.add_argument("--start-timeout-s", type=float, default=420.0)
    p.add_argument("--budget-s", type=float, default=1000.0, help="start no set-up or phase after this long")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--out", default="benchmarks/results/faults.json")
    p.add_argument("--plot", default="benchmarks/results/faults.png")
    p.add_argument("--plan", action="store_true", help="print the planned duration; start nothing")
    p.add_argument("--render", default=None, metavar="JSON", help="re-print the table of an earlier run")
    return p.parse_args(argv)


def on_sigterm(signum: int, _frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def write(res: dict, args: argparse.Namespace) -> None:
    text = fault_report.header(res) + fault_report.table(res)
    print(text)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1, default=str) + "\n")
        out.with_suffix(".txt").write_text(text)
        log(f"results written to {out} (+ .txt)")
    if args.plot:
        fault_report.plot(res, args.plot)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plan:
        print(f"planned ~{plan_s(args) / 60:.0f} min for set-ups {args.setups}")
        return 0
    if args.render:
        res = json.loads(Path(args.render).read_text())
        finish(res)
        print(fault_report.header(res) + fault_report.table(res))
        return CHECK_FAILED if res.get("check") else 0
    started = time.monotonic()
    signal.signal(signal.SIGTERM, on_sigterm)
    res: dict = {
        "benchmark": "faults", "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join(shlex.quote(x) for x in [os.path.relpath(sys.executable, ROOT), *sys.argv]),
        "git": git_state(ROOT), "host": {"cpus": procs.NCPU, "platform": platform.platform(),
                                         "before": procs.host_state()["loadavg"]},
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "plot", "plan", "render")},
        "setups": args.setups.split(","), "startup_s": {}, "references": {}, "reference_summary": {},
        "figures": {}, "streams": {}, "phase_info": {}, "fault_trail": {}, "setup_errors": {}, "tie_gaps": {},
        "seen_pids": [], "leftover_pids": [],
    }
    log(f"planned ~{plan_s(args) / 60:.0f} min")
    run = Run(args, res)
    rc = 0
    try:
        run.run()
    except BaseException as exc:  # noqa: BLE001 - report, clean up, write what was measured
        log(f"benchmark aborted: {exc!r}")
        res["aborted"] = repr(exc)
        rc = 1
    finally:
        run.stop()
        res["leftover_pids"] = sorted({p for p in res["seen_pids"] + res["leftover_pids"] if procs.alive(p)})
    res["host"]["after"] = procs.host_state()["loadavg"]
    try:
        if res["streams"]:
            judge_ties(res, run.model_path, run.prompts)
    except Exception as exc:  # noqa: BLE001 - without the gaps every mismatch stays wrong
        log(f"near-tie judging failed: {exc!r}")
        res["tie_error"] = repr(exc)
    res["wall_s"] = round(time.monotonic() - started, 1)
    check = finish(res)
    write(res, args)
    if check:
        log(f"FAILED: {check}")
        rc = rc or CHECK_FAILED
    return rc


if __name__ == "__main__":
    sys.exit(main())
