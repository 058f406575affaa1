"""Wait for an HTTP server to answer 200 (a front's `/health`, or vLLM's own server started as a child)."""

from __future__ import annotations

import subprocess
import time
from typing import Any

import httpx


class NotHealthy(TimeoutError):
    """The server did not answer 200 in time; `last` is its last answer's JSON body (None: no answer)."""

    def __init__(self, message: str, last: Any = None):
        super().__init__(message)
        self.last = last


def wait_healthy(url: str, timeout_s: float, proc: subprocess.Popen | None = None, interval_s: float = 0.3,
                 path: str = "/health") -> Any:
    """`url + path`'s JSON body once it answers 200 (None if it is not JSON); raises RuntimeError if `proc`
    exits first and `NotHealthy` once `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server for {url} exited with {proc.returncode}")
        try:
            r = httpx.get(url + path, timeout=5)
            try:
                last = r.json()
            except ValueError:
                last = None
            if r.status_code == 200:
                return last
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    raise NotHealthy(f"the server at {url} did not answer {path} with 200 in {timeout_s:.0f}s", last)
