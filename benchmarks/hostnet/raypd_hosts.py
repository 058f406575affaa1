"""raypd served across the hosts the way docs/multi-node.md tells an operator: `raypd up --config FILE
--address HEAD:6379` on the head's host, the engines pinned by the `prefill` / `decode` resources of the
other hosts' Ray nodes, the front on the head's address with API keys.

`RaypdOnHosts.start()` returns once `GET /health` answers 200 (bounded); `status()` runs
`raypd status` on the head's host; `stop()` sends SIGTERM (raypd's own clean shutdown), then SIGKILL.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from .ray_hosts import RayHosts

ROOT = Path(__file__).resolve().parents[2]
API_KEY = "sk-raypd-hosts-test"


@dataclass(frozen=True)
class Answer:
    """How one request ended: `outcome` completed | error_event | http_error | cut; seconds from send."""
    outcome: str
    text: str
    first_s: float | None
    second_s: float | None
    seconds: float
    status: int = 200


@dataclass
class RaypdOnHosts:
    ray: RayHosts
    config: Path
    port: int = 8000
    log_path: Path = field(init=False)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.ray.net.hosts[0].ip}:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def start(self, timeout_s: float = 420) -> "RaypdOnHosts":
        self.log_path = self.ray.workdir / "raypd-up.log"
        log = self.log_path.open("w")
        self.proc = self.ray.net.popen(
            0, [sys.executable, "-m", "serving.cli.main", "up", "--config", str(self.config),
                "--address", self.ray.address],
            env={**self.ray.env(0), "PYTHONPATH": str(ROOT)}, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"raypd up exited {self.proc.returncode}: {self.log_tail()}")
            if self.healthy():
                return self
            time.sleep(2)
        raise TimeoutError(f"raypd not healthy within {timeout_s} s: {self.log_tail()}")

    def healthy(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=3).status_code == 200
        except httpx.HTTPError:
            return False

    def health(self) -> tuple[int, str]:
        r = httpx.get(self.url + "/health", timeout=5)
        return r.status_code, r.text

    def status(self, as_json: bool = True) -> dict | str:
        argv = [sys.executable, "-m", "serving.cli.main", "status", "--address", self.ray.address]
        out = self.ray.net.run(0, argv + (["--json"] if as_json else []),
                               env={**self.ray.env(0), "PYTHONPATH": str(ROOT)}, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"raypd status failed: {out.stderr[-2000:]}")
        return json.loads(out.stdout) if as_json else out.stdout

    def driver(self, code: str, timeout: float = 120) -> str:
        """Python run as a Ray driver on the head's host (the coordinator and engines by name)."""
        out = self.ray.python(0, f"import sys; sys.path.insert(0, {str(ROOT)!r})\n" + code, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"driver failed: {out.stderr[-3000:]}")
        return out.stdout

    def complete(self, prompt: str, max_tokens: int = 12, timeout_s: float = 120) -> "Answer":
        """One streamed greedy completion: how it ended (completed, error_event, http_error, cut), its
        text, its first token's time and its wall time."""
        body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        t0 = time.monotonic()
        text, outcome, finish, first, second = "", "cut", None, None, None
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body, headers=self.headers,
                              timeout=timeout_s) as r:
                if r.status_code != 200:
                    return Answer("http_error", r.read().decode(), None, None, time.monotonic() - t0, r.status_code)
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        outcome = "completed" if finish else ("error_event" if outcome == "error_event" else "cut")
                        break
                    event = json.loads(line[6:])
                    if "error" in event:
                        outcome, text = "error_event", json.dumps(event["error"])
                        continue
                    for choice in event.get("choices", ()):
                        if choice.get("text"):
                            now = time.monotonic() - t0
                            first, second = (now, second) if first is None else (first, second or now)
                        text += choice.get("text") or ""
                        finish = choice.get("finish_reason") or finish
        except httpx.HTTPError:
            outcome = "cut" if outcome != "completed" else outcome
        return Answer(outcome, text, first, second, time.monotonic() - t0)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text()[-chars:]
        except OSError:
            return ""

    def stop(self, grace_s: float = 60) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
