"""A Ray cluster across the hosts of a `HostNet`: the head on host 0, one `ray start --address` node on
each other host, advertising a resource that names it (`host1`, ...) and the role it was given.

Every node runs with Ray's token auth on (one token per run, in a file) and UCX limited to TCP on the
host's own link (`UCX_TLS=tcp,self`, `UCX_NET_DEVICES=eth0`): the namespaces share one kernel, so UCX
would otherwise pick shared memory or CMA between them, which no two real machines can use. Ray's
workers (the engines, their vLLM processes, their NIXL agents) inherit this environment from
`ray start`, as docs/multi-node.md says for real clusters.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .netns import HostNet

RAY_BIN = Path(sys.executable).with_name("ray")
GCS_PORT = 6379


@dataclass
class RayHosts:
    """The run's Ray nodes. `env()` is what a process on a host needs to join (driver, `raypd up`)."""
    net: HostNet
    roles: dict[int, dict[str, float]] = field(default_factory=dict)  # host -> extra resources
    num_cpus: dict[int, int] = field(default_factory=dict)
    object_store_mb: int = 256
    extra_env: dict[str, str] = field(default_factory=dict)  # e.g. RAYPD_API_KEYS, on every node
    workdir: Path = field(init=False)
    token_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.workdir = self.net.workdir

    @property
    def address(self) -> str:
        return f"{self.net.hosts[0].ip}:{GCS_PORT}"

    def env(self, host: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "UCX_"))}
        env.update({
            "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_path),
            "RAY_USAGE_STATS_ENABLED": "0",
            "UCX_TLS": "tcp,self", "UCX_NET_DEVICES": self.net.hosts[host].dev,
            "RAYPD_HOST_INDEX": str(host),
            **self.extra_env,
        })
        env.pop("RAY_AUTH_TOKEN", None)
        return env

    def start(self, timeout_s: float = 120) -> "RayHosts":
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.token_path = self.workdir / "auth_token"
        self.token_path.write_text(secrets.token_hex(32))
        self.token_path.chmod(0o600)
        for host in range(len(self.net.hosts)):
            self._start_node(host)
        self.wait_nodes(len(self.net.hosts), timeout_s)
        return self

    def _start_node(self, host: int) -> None:
        h = self.net.hosts[host]
        res = {f"host{host}": 1, **self.roles.get(host, {})}
        argv = [str(RAY_BIN), "start", f"--node-ip-address={h.ip}", f"--num-cpus={self.num_cpus.get(host, 1)}",
                "--num-gpus=0", f"--resources={_json(res)}", f"--object-store-memory={self.object_store_mb << 20}",
                "--disable-usage-stats"]
        if host == 0:
            argv += ["--head", f"--port={GCS_PORT}", "--include-dashboard=false",
                     f"--temp-dir={self.workdir / 'ray'}"]
        else:
            argv += [f"--address={self.address}"]
        proc = self.net.run(host, argv, env=self.env(host), timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"ray start on host {host} failed: {proc.stderr[-2000:]}")

    def wait_nodes(self, count: int, timeout_s: float) -> None:
        """Until `count` nodes are alive in the head's view (bounded)."""
        deadline = time.monotonic() + timeout_s
        probe = "import ray; ray.init(address='auto'); print(sum(n['Alive'] for n in ray.nodes()))"
        while time.monotonic() < deadline:
            out = self.python(0, probe, timeout=60)
            if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(count)]:
                return
            time.sleep(1)
        raise TimeoutError(f"{count} Ray nodes not alive within {timeout_s} s")

    def python(self, host: int, code: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """Run Python code as a driver on `host` (RAY_ADDRESS points at the head)."""
        env = {**self.env(host), "RAY_ADDRESS": self.address}
        return self.net.run(host, [sys.executable, "-c", code], env=env, timeout=timeout)

    def restart_node(self, host: int) -> None:
        """A host that came back (after `lose`, its namespace is gone: rebuild it first)."""
        self._start_node(host)


def _json(d: dict) -> str:
    import json
    return json.dumps(d, separators=(",", ":"))
