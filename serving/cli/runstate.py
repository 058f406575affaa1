"""Where `raypd up` records itself, and how `raypd down` knows a pid is really that `raypd up`.

The state file lives in a per-user folder (`$XDG_RUNTIME_DIR/raypd`, else
`~/.cache/raypd/run`; mode 0700, files 0600), one file per Ray temp dir, so two
users, or two clusters of one user, never share one. Before signalling the
recorded pid, `raypd down` checks that the process belongs to this user, was
started when the record says (a reused pid fails this) and runs `raypd up`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil


@dataclass(frozen=True)
class UpState:
    pid: int
    create_time: float  # the process's start time (psutil), to tell a reused pid apart
    name: str
    url: str
    config: str | None  # the config file `up` was given (None: built from flags / the default)
    gcs_address: str
    started_cluster: bool
    ray_auth_mode: str  # "token" | "disabled": how status/down must connect


def run_dir() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime and Path(runtime).is_absolute():
        return Path(runtime) / "raypd"
    return Path.home() / ".cache" / "raypd" / "run"


def state_path(temp_dir: str) -> Path:
    key = hashlib.sha256(str(Path(temp_dir).resolve()).encode()).hexdigest()[:12]
    return run_dir() / f"up-{key}.json"


def write_state(temp_dir: str, state: UpState) -> Path:
    path = state_path(temp_dir)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(asdict(state), fh)
    os.replace(tmp, path)
    return path


def read_state(temp_dir: str) -> UpState | None:
    try:
        return UpState(**json.loads(state_path(temp_dir).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def remove_state(temp_dir: str, pid: int | None = None) -> None:
    """Remove the record (only if it is `pid`'s, when given)."""
    state = read_state(temp_dir)
    if state is not None and (pid is None or state.pid == pid):
        state_path(temp_dir).unlink(missing_ok=True)


def process_create_time(pid: int) -> float:
    return psutil.Process(pid).create_time()


def is_raypd_up_cmdline(argv: list[str]) -> bool:
    """`[python [opts]] .../raypd up ...` or `python [opts] -m serving.cli up ...`."""
    args = argv[1:] if argv and Path(argv[0]).name.startswith("python") else argv
    i = 0
    while i < len(args) and args[i].startswith("-") and args[i] not in ("-m", "-c"):
        i += 1  # interpreter options (-u, -B, ...)
    if args[i:i + 3] == ["-m", "serving.cli", "up"]:
        return True
    return len(args) > i + 1 and Path(args[i]).name == "raypd" and args[i + 1] == "up"


def live_up_process(state: UpState) -> str | None:
    """None when `state.pid` is this user's `raypd up` of that record; else why not."""
    try:
        proc = psutil.Process(state.pid)
        uid, argv, created = proc.uids().real, proc.cmdline(), proc.create_time()
    except psutil.NoSuchProcess:
        return f"pid {state.pid} is not running"
    except psutil.Error as exc:
        return f"pid {state.pid} cannot be inspected ({type(exc).__name__})"
    if uid != os.getuid():
        return f"pid {state.pid} belongs to uid {uid}, not to this user"
    if abs(created - state.create_time) > 1.0:
        return f"pid {state.pid} is another process (started after the record was written)"
    if not is_raypd_up_cmdline(argv):
        return f"pid {state.pid} is not `raypd up` ({' '.join(argv)[:80]!r})"
    return None
