"""A serving set-up under test as a group of processes this benchmark starts and stops.

Life cycle of a group: `start()` launches its processes (each in its own session,
logs under the run directory) and waits until every endpoint answers
/v1/models; `pin()` confines each vLLM worker to its engine's core (see
procs.pin_engine_workers); `idle_pids()` lists the processes whose CPU the idle
table reports; `stop()` asks politely (SIGTERM), then kills whatever of the
group's process tree is still alive, and returns the pids that survived even that.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from pdbench import procs

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


class SetupError(RuntimeError):
    pass


def free_port() -> int:
    """A port nothing listens on, below the kernel's ephemeral range: a port the kernel handed out
    (bind to 0) may be handed out again to one of Ray's own sockets before the server binds it
    (seen: Serve's proxy failed to bind its HTTP port)."""
    import random
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for port in random.Random().sample(range(20000, max(20001, low)), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise SetupError("no free port below the ephemeral range")


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{ROOT}:{HERE.parent}" + (f":{env['PYTHONPATH']}" if env.get("PYTHONPATH") else "")
    env.update({"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"})
    return env


class Group:
    key = "?"

    def __init__(self, settings: dict, model_path: str, run_dir: Path):
        self.s, self.model_path, self.run_dir = settings, model_path, run_dir
        self.procs: list[subprocess.Popen] = []
        self.endpoints: dict[str, str] = {}  # set-up key -> base URL (without /v1)
        self.headers: dict[str, str] = {}  # on every request to the endpoints (an API key across hosts)
        self.pinned: list[dict] = []
        self.log_paths: list[Path] = []
        self._logged_binds: dict[int, str] = {}

    # ---------------------------------------------------------------- helpers
    def spawn(self, name: str, cmd: list[str], env: dict | None = None, stdin: bool = False,
              netns: str | None = None) -> subprocess.Popen:
        """`netns`: run it inside that network namespace (a host of benchmarks/hostnet; `ip netns exec`
        execs the command, so the pid is the command's own)."""
        if netns is not None:
            cmd = ["ip", "netns", "exec", netns, *cmd]
        log = self.run_dir / f"{self.key}-{name}.log"
        self.log_paths.append(log)
        fh = open(log, "ab")
        proc = subprocess.Popen(cmd, env=env or base_env(), stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                start_new_session=True, cwd=ROOT)
        fh.close()
        self.procs.append(proc)
        return proc

    def wait_ready(self, urls: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(urls)
        while pending:
            for p in self.procs:
                if p.poll() is not None:
                    raise SetupError(f"{self.key}: {p.args[:4]}... exited with {p.returncode} during start-up "
                                     f"(logs: {', '.join(map(str, self.log_paths))})")
            url = pending[0]
            try:
                if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                    pending.pop(0)
                    continue
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SetupError(f"{self.key}: {url} not ready after {timeout_s:.0f}s")
            time.sleep(0.5)

    def roots(self) -> list[int]:
        return [p.pid for p in self.procs]

    def all_pids(self) -> list[int]:
        return procs.tree(*self.roots())

    def log_files(self) -> list[Path]:
        files = list(self.log_paths)
        logs = self.session_logs()
        if logs is not None and logs.exists():
            files += [p for p in logs.iterdir() if p.suffix in (".out", ".err", ".log")]
        return files

    def session_logs(self) -> Path | None:
        return None

    def binds(self, pids: list[int]) -> dict[int, str]:
        """pid -> engine core bind; vLLM's log lines are read once per set of engine cores."""
        cores = {p for p in pids if procs.proc_name(p).startswith("VLLM::EngineCore")}
        if not cores <= set(self._logged_binds):
            self._logged_binds = procs.binds_from_logs(self.log_files())
        return procs.resolve_binds(pids, self._logged_binds)

    def pin(self) -> list[dict]:
        pids = self.all_pids()
        done = procs.pin_engine_workers(pids, self.binds(pids))
        self.pinned = [vars(d) for d in done]
        return self.pinned

    def idle_pids(self) -> list[int]:
        return self.all_pids()

    def stop(self, grace_s: float = 90.0) -> list[int]:
        seen = set(self.all_pids())
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        seen |= set(self.all_pids())
        for pid in seen:
            if procs.alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        time.sleep(1.0)
        self.procs = []
        return sorted(pid for pid in seen if procs.alive(pid))

    def vllm_server(self, name: str, core: str, port: int, nixl_side_port: int | None = None,
                    host: str = "127.0.0.1", netns: str | None = None,
                    extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        """`host`/`netns`: listen (and publish the NIXL side channel) on a hostnet host's address."""
        s = self.s
        env = base_env()
        env.update({"VLLM_CPU_OMP_THREADS_BIND": core, "VLLM_CPU_KVCACHE_SPACE": str(s["kv_cache_gib"]),
                    **(extra_env or {})})
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_path,
               "--served-model-name", s["served_model_name"], "--host", host, "--port", str(port),
               "--dtype", s["dtype"], "--enforce-eager", "--max-model-len", str(s["max_model_len"]),
               "--block-size", str(s["block_size"]), "--max-num-seqs", str(s["max_num_seqs"]),
               "--max-num-batched-tokens", str(s["max_num_batched_tokens"]), "--seed", "0",
               "--enable-prefix-caching" if s["enable_prefix_caching"] else "--no-enable-prefix-caching",
               "--disable-uvicorn-access-log"]
        if nixl_side_port is not None:
            env.update({"VLLM_NIXL_SIDE_CHANNEL_PORT": str(nixl_side_port),
                        "VLLM_NIXL_SIDE_CHANNEL_HOST": host})
            cmd += ["--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})]
        return self.spawn(name, cmd, env, netns=netns)

    def proxy(self, port: int, mode_args: list[str], host: str = "127.0.0.1",
              netns: str | None = None) -> subprocess.Popen:
        return self.spawn("proxy", [sys.executable, str(HERE / "proxy.py"), "--host", host, "--port", str(port),
                                    *mode_args], netns=netns)
