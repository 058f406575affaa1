"""Wait for an HTTP server's `/health` to answer 200 (a front or vLLM's own server started as a child)."""

from __future__ import annotations

import subprocess
import time

import httpx


def wait_healthy(url: str, timeout_s: float, proc: subprocess.Popen | None = None, interval_s: float = 0.3) -> None:
    """Return once `url`/health answers 200; raise if `proc` exits first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server for {url} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(interval_s)
    raise TimeoutError(f"the server at {url} did not become healthy in {timeout_s:.0f}s")
