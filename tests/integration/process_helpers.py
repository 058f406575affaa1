"""Process-tree helpers for tests that run `raypd up` in a subprocess: what it started, and waiting on its log."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


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


def start_time(pid: int) -> str | None:
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
            t = start_time(child)
            if t is not None:
                out[child] = t
                todo.append(child)
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
    except OSError:
        return "?"


def wait_for_line(log: Path, proc: subprocess.Popen, marker: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while marker not in log.read_text():
        assert proc.poll() is None, f"raypd up exited early:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"raypd up did not come up:\n{log.read_text()}"
        time.sleep(0.5)
    return log.read_text()


def survivors(tree: dict[int, str], timeout_s: float = 20.0) -> dict[int, str]:
    """The processes of `tree` still alive after `timeout_s` (Ray reaps its workers asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = {p: t for p, t in tree.items() if start_time(p) == t}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.25)


def reap(proc: subprocess.Popen, tree: dict[int, str], temp_dir: str) -> None:
    """After a test of `raypd up`, pass or fail: its process, what it started, its Ray temp dir gone."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(30)
    kill_all(tree)
    subprocess.run(["rm", "-rf", temp_dir], check=False)


def kill_all(tree: dict[int, str]) -> None:
    """SIGKILL what is left of `tree` (never strand processes, even when a test failed)."""
    for pid, t in tree.items():
        if start_time(pid) == t:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
