"""A host lost under the default deployment, measured from the client: what happens to the streams in
flight, and to every request after the loss, on three network-namespace hosts (`benchmarks/hostnet/`).

Deployment: `configs/multihost-default.yaml` (two role-flexible `both` SmolLM2 engines, one on host 1 and
one on host 2, SLO placement; the front and the coordinator on host 0). Four greedy streams are in flight
when every process on host 2 is SIGKILLed and its namespace deleted (`HostNet.lose`); then one request
every `--every-s` seconds for `--seconds`, each with its outcome, time and the front's /health. At the end:
which engines are registered and healthy, and the lines of the router's and the coordinator's logs that
say what they decided (a dead engine, a missed deadline, a failed probe), with Ray's own node-death line.

    sudo .venv/bin/python benchmarks/host_lost.py [--runs 3] [--out benchmarks/results/host_lost.txt]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from benchmarks.hostnet.netns import HostNet, leftovers  # noqa: E402
from benchmarks.hostnet.ray_hosts import RayHosts  # noqa: E402
from benchmarks.hostnet.raypd_hosts import API_KEY, RaypdOnHosts  # noqa: E402
from benchmarks.hosts_faults import SHORT, prompt  # noqa: E402

DECISIONS = re.compile(r"treated as hung|is dead|failed a probe|is hung|unavailable before|marked dead|continued on")


def health(rp: RaypdOnHosts) -> str:
    try:
        r = httpx.get(rp.url + "/health", timeout=5)
        return f"{r.status_code} {r.json().get('code')}"
    except (httpx.HTTPError, ValueError) as exc:
        return type(exc).__name__


def ray_cpu_s() -> dict[str, float]:
    """CPU seconds used so far by Ray's GCS and metrics agents (every host's, by process name)."""
    import psutil

    used: dict[str, float] = {}
    for p in psutil.process_iter(["name", "cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or ())
            kind = "gcs_server" if "gcs_server" in (p.info["name"] or "") else (
                "dashboard_agent" if "dashboard/agent.py" in cmd or "DashboardAgent" in cmd else None)
            if kind:
                t = p.cpu_times()
                used[kind] = used.get(kind, 0.0) + t.user + t.system
        except (psutil.Error, OSError):
            continue
    return used


def decisions(workdir: Path) -> list[str]:
    """What the router, the coordinator and Ray said they decided (their logs, in order of the files)."""
    lines = []
    for f in sorted((workdir / "ray" / "session_latest" / "logs").glob("worker-*.err")) + [workdir / "raypd-up.log"]:
        try:
            text = f.read_text(errors="replace")
        except OSError:
            continue
        lines += [re.sub(r"\x1b\[[0-9;]*m", "", ln).strip()[:240] for ln in text.splitlines() if DECISIONS.search(ln)]
    return lines


def run(seconds: float, every_s: float) -> dict:
    out: dict = {}
    net = HostNet(3).up()
    try:
        rh = RayHosts(net, roles={1: {"prefill": 1, "engine": 1}, 2: {"decode": 1, "engine": 1}},
                      num_cpus={0: 2, 1: 1, 2: 1}, extra_env={"RAYPD_API_KEYS": API_KEY}).start()
        rp = RaypdOnHosts(rh, ROOT / "configs" / "multihost-default.yaml").start()
        for city in ("Paris", "Rome"):
            rp.complete(prompt(city, SHORT), 16)
        t_loss = 0.0

        def stream(city: str) -> dict:
            a = rp.complete(prompt(city, SHORT), 64, timeout_s=150)
            return {"request": city, "outcome": a.outcome, "ended_after_loss_s": round(time.monotonic() - t_loss, 1)}

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(stream, c) for c in ("Lyon", "Oslo", "Vienna", "Prague")]
            time.sleep(3)
            t_loss = time.monotonic()
            cpu0 = ray_cpu_s()
            net.lose(2)
            after = []
            k = 0
            while time.monotonic() - t_loss < seconds:
                sent = round(time.monotonic() - t_loss, 1)
                a = rp.complete(prompt(f"Bergen {k}", SHORT), 8, timeout_s=60)
                after.append({"sent_after_loss_s": sent, "outcome": a.outcome, "seconds": round(a.seconds, 2),
                              "status": a.status, "health": health(rp),
                              "error": a.text[:160] if a.outcome != "completed" else None})
                k += 1
                time.sleep(max(0.0, every_s - a.seconds))
            out["in_flight"] = [f.result() for f in futures]
        cpu1 = ray_cpu_s()
        out["ray_cpu_s_after_loss"] = {k: round(cpu1.get(k, 0.0) - cpu0.get(k, 0.0), 1) for k in cpu1}
        out["seconds_after_loss"] = round(time.monotonic() - t_loss, 1)
        out["after"] = after
        st = rp.status()
        out["engines_at_end"] = {n: {"registered": e.get("registered"), "healthy": e.get("healthy")}
                                 for n, e in st["engines"].items()}
        out["decisions"] = decisions(rh.workdir)
        rp.stop()
    finally:
        net.down()
        out["teardown_leftovers"] = leftovers(net.run_id)
    return out


def report(o: dict) -> str:
    runs = o["runs"]
    lines = [f"# host_lost.py  commit {o['commit'][:12]}{' (dirty)' if o['dirty'] else ''}  {o['date']}",
             "# 3 network-namespace hosts on one 2-core machine; configs/multihost-default.yaml (both engines on hosts 1 "
             f"and 2); every process of host 2 killed with 4 streams in flight; {len(runs)} run(s), fresh hosts each"]
    for i, r in enumerate(runs, 1):
        if len(runs) > 1:
            lines.append(f"run {i}")
        lines += run_lines(r)
    if len(runs) > 1:
        whole = [r for r in runs if r.get("in_flight") and all(s["outcome"] == "completed" for s in r["in_flight"])]
        last = [max((s["ended_after_loss_s"] for s in r.get("in_flight", ())), default=None) for r in runs]
        first_after = [next((a["sent_after_loss_s"] for a in r.get("after", ()) if a["outcome"] == "completed"), None)
                       for r in runs]
        lines.append(f"every stream in flight completed in {len(whole)} of {len(runs)} runs; the last one ended "
                     f"{last} s after the loss; the first request answered was sent {first_after} s after it")
    return "\n".join(lines) + "\n"


def run_lines(o: dict) -> list[str]:
    lines = []
    for r in o.get("in_flight", []):
        lines.append(f"  in flight  {r['request']:<8} {r['outcome']:<12} ended {r['ended_after_loss_s']} s after the loss")
    for r in o.get("after", []):
        lines.append(f"  sent {r['sent_after_loss_s']:>6} s after  {r['outcome']:<12} {r['seconds']:>6} s  "
                     f"/health {r['health']}" + (f"  {r['error']}" if r["error"] else ""))
    lines.append(f"  engines at the end: {o.get('engines_at_end')}")
    lines.append(f"  CPU seconds of Ray's GCS and metrics agents in the {o.get('seconds_after_loss')} s after the loss "
                 f"(2 cores): {o.get('ray_cpu_s_after_loss')}")
    lines.append("  what the router, the coordinator and Ray logged:")
    lines += [f"    {ln}" for ln in o.get("decisions", [])]
    lines.append(f"  teardown leftovers: {o.get('teardown_leftovers')}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "host_lost.txt"))
    ap.add_argument("--seconds", type=float, default=75.0, help="how long requests are sent after the loss")
    ap.add_argument("--every-s", type=float, default=4.0, help="one request this often")
    ap.add_argument("--runs", type=int, default=1, help="the whole run this many times (fresh hosts each time)")
    args = ap.parse_args()
    git = ["git", "-C", str(ROOT)]
    out = {"commit": subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
           "dirty": bool(subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"],
                                        capture_output=True, text=True).stdout.strip()),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    out["runs"] = [run(args.seconds, args.every_s) for _ in range(args.runs)]
    Path(args.out).with_suffix(".json").write_text(json.dumps(out, indent=1))
    Path(args.out).write_text(report(out))
    print(report(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
