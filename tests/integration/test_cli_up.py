"""`raypd up` in a subprocess (its own Ray cluster and temp dir), a request, `raypd status`, SIGINT, nothing left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from service_helpers import SYNTHETIC, free_port

ROOT = Path(__file__).resolve().parents[2]
RAYPD = [sys.executable, "-m", "serving.cli"]


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def _start_time(pid: int) -> str | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == "Z" else fields[19]  # state, ..., starttime


def descendants(pid: int) -> dict[int, str]:
    """Every live process below `pid`, with its start time (to tell a reused pid apart)."""
    tree, out, todo = _children(), {}, [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            t = _start_time(child)
            if t is not None:
                out[child] = t
                todo.append(child)
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
    except OSError:
        return "?"


@pytest.mark.slow
def test_up_serves_then_sigint_leaves_no_ray_process(tmp_path):
    port = free_port()
    temp_dir = f"/tmp/raypd-cli-{uuid.uuid4().hex[:8]}"
    config = tmp_path / "cli.yaml"
    config.write_text(yaml.safe_dump({**SYNTHETIC, "name": "cli-test",
                                      "http": {"host": "127.0.0.1", "port": port}, "ray": {"num_cpus": 2}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.update(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled", PYTHONUNBUFFERED="1")
    log = tmp_path / "up.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([*RAYPD, "up", "--config", str(config), "--temp-dir", temp_dir], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    tree: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 180
        while "Ctrl-C to stop" not in log.read_text():
            assert proc.poll() is None, f"raypd up exited early:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"raypd up did not come up:\n{log.read_text()}"
            time.sleep(0.5)
        text = log.read_text()
        assert f"http://127.0.0.1:{port}/v1 (ready)" in text, text
        assert "prefill cli-test-prefill-0" in text and "decode  cli-test-decode-0" in text, text

        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                       json={"model": "synthetic-tiny", "prompt": "hello", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3

        status = subprocess.run([*RAYPD, "status", "--temp-dir", temp_dir], cwd=ROOT, env=env,
                                capture_output=True, text=True, timeout=120)
        assert status.returncode == 0, status.stdout + status.stderr
        assert "front: healthy" in status.stdout and "cli-test-decode-0" in status.stdout, status.stdout
        assert "cli-test-prefill-0->cli-test-decode-0" in status.stdout and "closed" in status.stdout

        tree = descendants(proc.pid)
        names = " ".join(_cmdline(p) for p in tree)
        assert "raylet" in names and "gcs_server" in names, names
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0, log.read_text()
        assert "raypd: stopped" in log.read_text()
        assert not (Path(temp_dir) / "raypd-up.json").exists()
        deadline = time.monotonic() + 20
        while True:  # Ray reaps its workers asynchronously: give it a moment
            left = {p: t for p, t in tree.items() if _start_time(p) == t}
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        assert not left, "left behind: " + "; ".join(f"{p} {_cmdline(p)}" for p in left)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        for pid, t in (tree or {}).items():  # never strand processes, even when the test failed
            if _start_time(pid) == t:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        subprocess.run(["rm", "-rf", temp_dir], check=False)
