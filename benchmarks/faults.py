#!/usr/bin/env python
"""One fault schedule for every P/D set-up: the wrong-answer rate and the goodput under each fault.

  sudo flock /tmp/raypd-cpu.lock .venv/bin/python benchmarks/faults.py        # (b), (e), (c); ~30 min
  .venv/bin/python benchmarks/faults.py --plan                                 # the planned duration only
  .venv/bin/python benchmarks/faults.py --render benchmarks/results/faults.json  # re-print the table

Set-ups (pdbench/setups.py, the same as benchmarks/pd_vs_vllm.py: SmolLM2-135M-Instruct, float32,
block size 128, one core per engine): (b) raypd 1P+1D, (e) raypd's default (2 engines of role
both, SLO placement), (c) vLLM NixlConnector P/D (two vLLM OpenAI servers + vLLM's proxy logic).
(d) Ray Serve LLM P/D is not run (the results file says why).

Per set-up: start it, pin its engines to their cores, compute the greedy reference of every prompt
one at a time (batch 1) while healthy, then one phase per fault. A phase is an open-loop stream
(same prompts, same arrival times everywhere; pdbench/fault_client.py) with the fault injected
`--fault-at-s` after its first send:
  decode SIGSTOP   the decode engine's process tree stopped for --stop-s, then SIGCONT
  prefill SIGKILL  the prefill engine's tree killed while pulls are in flight
  decode SIGKILL   the decode engine's tree killed
  P<->D partition  the set-up started again across three hosts (network namespaces, root only:
                   pdbench/hosts_groups.py): the prefill side on host 1, the decode side on host 2,
                   the front on host 0; its references again, then hosts 1 and 2 cut from each other
                   for --partition-s (both still reach host 0), then healed
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
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

from serving.bench.provenance import git_state  # noqa: E402
from pdbench import fault_client, fault_inject, fault_outcomes, fault_report, fault_results  # noqa: E402
from pdbench import faults, hosts_groups, procs, setups  # noqa: E402

CHECK_FAILED = 3
GROUP = {"b": "B", "e": "E", "c": "C"}
RAYPD = {"b", "e"}
# (name, role, action, --phases key)
PHASES = (("decode SIGSTOP", "decode", "stop", "decode-stop"), ("prefill SIGKILL", "prefill", "kill", "prefill-kill"),
          ("decode SIGKILL", "decode", "kill", "decode-kill"))
STOP_PHASES = {p for p, _, a, _ in PHASES if a == "stop"}
PARTITION = "P<->D partition (hosts)"
ENGINE_SETTINGS = dict(served_model_name="smollm2", dtype="float32", max_model_len=2304, block_size=128,
                       enable_prefix_caching=True, max_num_seqs=128, max_num_batched_tokens=2048,
                       kv_cache_gib=1, raypd_config="benchmarks/configs/pd_1p1d.yaml",
                       raypd_default_config="benchmarks/configs/pd_default.yaml")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


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

    def references(self, setup: str, url: str) -> tuple[list[str], str]:
        """The batch-1 greedy answers of the healthy set-up (after two warm-up requests), and a summary."""
        a, model, headers = self.args, self.settings["served_model_name"], self.group.headers
        warm = fault_client.prompts(a.seed + 1, 2, a.prompt_tokens, self.vocab)
        asyncio.run(fault_client.reference(url, model, warm, a.max_tokens, a.limit_s, headers))
        refs = asyncio.run(fault_client.reference(url, model, self.prompts, a.max_tokens, a.limit_s, headers))
        bad = [r for r in refs if not (r.status == 200 and r.done and r.error_event is None)]
        took = max((r.end_s or 0.0) for r in refs)
        log(f"{setup}: references {len(refs) - len(bad)}/{len(refs)} in {took:.0f} s")
        if bad:
            raise setups.SetupError(f"reference failed on the healthy set-up: {bad[0].to_json()}")
        return [r.text for r in refs], f"{len(refs)}/{len(refs)} in {took:.0f} s"

    def one_setup(self, setup: str) -> None:
        a = self.args
        chosen = a.phases.split(",")
        one_host = [ph for ph in PHASES if ph[3] in chosen]
        if one_host:
            self.one_host(setup, one_host)
        if "partition" in chosen and a.partition_s > 0:
            self.partition_phase(setup)

    def one_host(self, setup: str, phases: list[tuple[str, str, str, str]]) -> None:
        a = self.args
        self.budget(f"starting {setup}")
        log(f"{setup}: starting")
        self.res["startup_s"][setup] = self.start(setup)
        url = next(iter(self.group.endpoints.values()))
        if setup in RAYPD:
            self.trail = faults.FaultTrail(self.res["fault_trail"].setdefault(setup, []))
        try:
            self.res["references"][setup], self.res["reference_summary"][setup] = self.references(setup, url)
        finally:
            self.read_faults("reference")
        engines = len(fault_inject.engine_cores(self.group))
        restart = False
        for name, role, action, _ in phases:
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
            inj = fault_inject.Injector.signals(pids, action, time.monotonic() + 0.5, a.fault_at_s, a.stop_s)
            log(f"{setup}: {name} (targets {info['target']})")
            fig = self.measure(setup, name, url, inj, info)
            if isinstance(self.group, setups.RaypdUp):
                self.settle(name, info, before, engines, set(inj.hit) if action == "kill" else set())
            else:
                info["at_rest"] = fault_inject.at_rest(self.group)
                restart = action == "kill"
            log(f"{setup}: {name}: {fig.counts} goodput {fig.goodput_before}|{fig.goodput_during}|"
                f"{fig.goodput_after} first good {fig.first_good_s} {info.get('at_rest')}")

    def partition_phase(self, setup: str) -> None:
        """The set-up again with its engines on two hosts (pdbench/hosts_groups.py): references, then
        the open loop with hosts 1 and 2 cut from each other for --partition-s (both still reach host 0)."""
        a = self.args
        why_not = hosts_groups.needs_root()
        if why_not:
            log(f"{setup}: {PARTITION} not run: {why_not}")
            return
        self.budget(PARTITION)
        self.stop()
        info: dict = {}
        self.res["phase_info"].setdefault(setup, {})[PARTITION] = info
        log(f"{setup}: starting across hosts")
        t = time.monotonic()
        g = hosts_groups.make_group(GROUP[setup], self.settings, self.model_path, self.run_dir)
        self.group = g
        g.start()
        info["hosts_startup_s"] = round(time.monotonic() - t, 1)
        self.res["seen_pids"] += g.all_pids()
        info["pinned"] = len(g.pin())
        url = next(iter(g.endpoints.values()))
        if setup in RAYPD:  # a new front: its counters start from zero
            self.trail = faults.FaultTrail(self.res["fault_trail"].setdefault(setup, []))
        rx0 = g.net.bytes(hosts_groups.DECODE_HOST)[0]
        refs, info["references"] = self.references(f"{setup} across hosts", url)
        info["decode_host_rx_mb"] = round((g.net.bytes(hosts_groups.DECODE_HOST)[0] - rx0) / 1e6, 1)
        self.res["phase_references"].setdefault(setup, {})[PARTITION] = refs
        if setup in self.res["references"]:
            same = sum(x == y for x, y in zip(refs, self.res["references"][setup]))
            info["references"] += f", {same} equal to the one-host set-up's"
        self.read_faults("reference across hosts")
        before = g.decisions() if setup in RAYPD else None
        net = g.net

        def cut() -> list:
            net.partition(hosts_groups.PREFILL_HOST, hosts_groups.DECODE_HOST)
            return [hosts_groups.PREFILL_HOST, hosts_groups.DECODE_HOST]

        inj = fault_inject.Injector(cut, net.heal, time.monotonic() + 0.5, a.fault_at_s, a.partition_s)
        log(f"{setup}: {PARTITION} ({a.partition_s:.0f} s)")
        fig = self.measure(setup, PARTITION, url, inj, info)
        info["partition_s"] = round(info["until_s"] - info["fault_s"], 1)
        if setup in RAYPD:
            self.settle(PARTITION, info, before, 0, set())
        else:
            info["at_rest"] = fault_inject.at_rest(g)
        log(f"{setup}: {PARTITION}: {fig.counts} goodput {fig.goodput_before}|{fig.goodput_during}|"
            f"{fig.goodput_after} first good {fig.first_good_s} {info.get('at_rest')}")

    def measure(self, setup: str, name: str, url: str, inj: fault_inject.Injector,
                info: dict) -> fault_outcomes.PhaseFigures:
        """The phase's open loop while `inj` fires: streams and fault times into the results."""
        a = self.args
        inj.start()
        streams = asyncio.run(fault_client.open_loop(url, self.settings["served_model_name"], self.prompts, self.at_s,
                                                      a.max_tokens, a.limit_s, inj.t0, self.group.headers))
        inj.join()
        info["signalled"] = len(inj.hit)
        fault_s = inj.fault_s if inj.fault_s is not None else a.fault_at_s
        until = inj.until_s if inj.until_s is not None else fault_s + a.kill_window_s
        end = max([s.end_s or 0.0 for s in streams] + [until])
        refs = fault_results.references_of(self.res, setup, name)
        outs = [fault_outcomes.classify(s, refs[s.idx]) for s in streams]
        self.res["streams"].setdefault(setup, {})[name] = [s.to_json() for s in streams]
        info["fault_s"], info["until_s"], info["end_s"] = fault_s, until, round(end, 2)
        return fault_outcomes.aggregate(outs, fault_outcomes.Window(fault_s, until, end))  # the log's (no ties)

    def settle(self, name: str, info: dict, before: dict | None, engines: int, gone: set[int]) -> None:
        """raypd after a phase: recovered (engines back, /health 200), what is left at rest, placement."""
        a = self.args
        info["recovered_s"] = fault_inject.wait_raypd_recovered(self.group, engines, gone, a.recover_s)
        self.group.pin()
        time.sleep(3.0)
        info["at_rest"], info["at_rest_after_s"] = fault_inject.wait_at_rest(self.group, a.rest_wait_s)
        now = self.group.decisions()
        if before is not None and "error" not in now and "error" not in before:
            info["placement"] = {k: v - before.get(k, 0) for k, v in now.items() if v - before.get(k, 0)}
        self.read_faults(name)
        if info["recovered_s"] is None:
            log(f"not recovered within {a.recover_s:.0f} s after {name}")
            raise setups.SetupError(f"not recovered within {a.recover_s:.0f} s after {name}")


def plan_s(a: argparse.Namespace) -> float:
    """A rough duration: per set-up a start, the references, per phase its arrivals + a drain + recovery."""
    arrivals = fault_client.arrivals(a.seed, a.requests, a.rate)[-1]
    per_phase = arrivals + 25 + 45
    n = len(a.setups.split(","))
    chosen = a.phases.split(",")
    one_host = sum(ph[3] in chosen for ph in PHASES)
    hosts = (90 + 2 * a.requests + per_phase + a.partition_s) if "partition" in chosen and a.partition_s > 0 else 0
    return n * ((60 + 2 * a.requests + one_host * per_phase) * bool(one_host) + hosts) + ("c" in a.setups) * 2 * 50


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
    p.add_argument("--phases", default="decode-stop,prefill-kill,decode-kill,partition",
                   help="which faults: decode-stop, prefill-kill, decode-kill, partition")
    p.add_argument("--partition-s", type=float, default=20.0,
                   help="P<->D partition across hosts (pdbench/hosts_groups.py); 0: no partition phase")
    p.add_argument("--kill-window-s", type=float, default=30.0, help="the 'during' window after a SIGKILL")
    p.add_argument("--limit-s", type=float, default=120.0, help="a request without an outcome by then is hung")
    p.add_argument("--recover-s", type=float, default=240.0, help="raypd: wait this long for a killed engine")
    p.add_argument("--rest-wait-s", type=float, default=60.0,
                   help="raypd: after a phase, wait this long for every lease and block to be released")
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
        fault_results.finish(res, RAYPD, STOP_PHASES)
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
        "phase_references": {},
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
            fault_results.judge_ties(res, run.model_path, run.prompts)
    except Exception as exc:  # noqa: BLE001 - without the gaps every mismatch stays wrong
        log(f"near-tie judging failed: {exc!r}")
        res["tie_error"] = repr(exc)
    res["wall_s"] = round(time.monotonic() - started, 1)
    check = fault_results.finish(res, RAYPD, STOP_PHASES)
    write(res, args)
    if check:
        log(f"FAILED: {check}")
        rc = rc or CHECK_FAILED
    return rc


if __name__ == "__main__":
    sys.exit(main())
