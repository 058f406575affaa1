"""Ray's log monitor idle, Ray's defaults against raypd's serving profile (serving/cluster/ray_profile.py).

The log monitor tails every worker's log file for the driver. With Ray's defaults it globs the logs
folder for new files on every 0.1 s pass; the serving profile looks for new files every 5 s
(RAY_LOG_MONITOR_MANY_FILES_THRESHOLD=0, LOG_NAME_UPDATE_INTERVAL_S=5). Each setting runs Ray's own
`LogMonitor.run` loop in a fresh process (both variables are read at import) over a logs folder shaped
like `raypd up`'s, with nothing to publish, for --seconds; settings alternate over --rounds. Each run
then writes a line to a known file and a line to a new worker's file, and reports when each was
published (nothing is lost; the new file's line waits for the next look).

Usage: python benchmarks/log_monitor_idle.py [--rounds 3] [--seconds 30] [--workers 24] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from serving.bench.provenance import git_state, header_line  # noqa: E402
from serving.cluster.ray_profile import SERVING_NODE_ENV  # noqa: E402

KEYS = ("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "LOG_NAME_UPDATE_INTERVAL_S")
SETTINGS = {"ray": {}, "serving": {k: SERVING_NODE_ENV[k] for k in KEYS}}

CHILD = r'''
import json, sys, tempfile, threading, time
workers, seconds = int(sys.argv[1]), float(sys.argv[2])
logs = tempfile.mkdtemp(prefix="raypd-logmon-")
def worker_file(i, ext):
    return f"{logs}/worker-{i:056x}-01000000-{1000 + i}.{ext}"
for i in range(workers):
    for ext in ("out", "err"):
        with open(worker_file(i, ext), "w") as f:
            f.write(":actor_name:EngineActor\nstarted\n")
for name in ("raylet.err", "raylet.out", "gcs_server.err", "gcs_server.out", "monitor.log", "dashboard.log"):
    with open(f"{logs}/{name}", "w") as f:
        f.write("started\n")
from ray._private.log_monitor import LogMonitor
published = {}
class Gcs:
    def publish_logs(self, data):
        for line in data["lines"]:
            published.setdefault(line, time.monotonic())
monitor = LogMonitor("127.0.0.1", logs, Gcs(), lambda pid: True)
threading.Thread(target=monitor.run, daemon=True).start()
time.sleep(2.0)  # its first look: every file opened and read once
c0, t0 = time.process_time(), time.monotonic()
time.sleep(seconds)
idle = (time.process_time() - c0) / (time.monotonic() - t0)
def published_after(path, line):
    t = time.monotonic()
    with open(path, "a") as f:
        f.write(line + "\n")
    while line not in published and time.monotonic() - t < 30:
        time.sleep(0.01)
    return published.get(line, float("nan")) - t
known = published_after(worker_file(0, "out"), "a line to a known file")
new = published_after(worker_file(workers, "out"), "a line to a new file")
print(json.dumps({"idle": idle, "files": len(monitor.log_filenames), "known_s": known, "new_s": new}))
'''


def one_run(setting: str, args) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in KEYS} | SETTINGS[setting]
    out = subprocess.run([sys.executable, "-c", CHILD, str(args.workers), str(args.seconds)], env=env,
                         capture_output=True, text=True, check=True, timeout=args.seconds + 120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--workers", type=int, default=24, help="worker processes whose .out/.err the folder holds")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    load_before = round(os.getloadavg()[0], 2)
    order = [s for r in range(args.rounds) for s in (("ray", "serving") if r % 2 == 0 else ("serving", "ray"))]
    runs: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    for setting in order:
        runs[setting].append(one_run(setting, args))

    def median(setting: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[setting])

    lines = [f"# {time.strftime('%Y-%m-%dT%H:%M:%S%z')}; command: {' '.join(sys.argv)}", header_line(git_state(ROOT)),
             f"# host: {os.cpu_count()} CPUs; load average before {load_before} (1 min)",
             f"Ray's LogMonitor.run over {args.workers} workers' .out/.err and 6 node logs "
             f"({runs['ray'][0]['files']} files tracked), nothing to publish, {args.seconds:g} s per run; "
             f"{args.rounds} rounds in order {' '.join(order)}; medians",
             f"{'setting':<8} {'variables':<70} {'idle % of a core':>16} {'runs':>20} {'known file line':>16} "
             f"{'new file line':>14}"]
    for setting in SETTINGS:
        variables = " ".join(f"{k}={v}" for k, v in SETTINGS[setting].items()) or "(Ray's defaults)"
        each = ", ".join(f"{100 * r['idle']:.2f}" for r in runs[setting])
        lines.append(f"{setting:<8} {variables:<70} {100 * median(setting, 'idle'):>16.2f} {each:>20} "
                     f"{1e3 * median(setting, 'known_s'):>13.0f} ms {1e3 * median(setting, 'new_s'):>11.0f} ms")
    lines.append(f"serving / ray idle CPU: {median('serving', 'idle') / median('ray', 'idle'):.2f}x "
                 f"({100 * (median('ray', 'idle') - median('serving', 'idle')):.2f} % of a core saved)")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
