"""Set-ups (b), (e) and (c) with their engines on separate hosts, for the P<->D partition phase of
benchmarks/faults.py: three network-namespace hosts (benchmarks/hostnet), host 1 the prefill side,
host 2 the decode side, host 0 the front; the client stays in this (root) namespace.

  RaypdAcrossHosts      (b), (e): a Ray cluster across the hosts (head on 0, a node on 1 and 2, token auth
                        and UCX on TCP: benchmarks/hostnet/ray_hosts.py), then `raypd up --address` of the
                        benchmark's own config with each engine pinned to its host by resources
                        ((b): `prefill` on 1, `decode` on 2; (e): one `engine` on each), the front on host 0
                        with an API key. Engine cores, vLLM settings and placement are the one-host set-up's.
  VllmNixlPDAcrossHosts (c): the prefill vLLM server in host 1, the decode one in host 2, each publishing
                        its NIXL side channel on its host's address with UCX on TCP over its link, and
                        the proxy in host 0.

Each owns its `HostNet`: built in `start()`, removed (every process of every host killed, the
namespaces and links deleted) in `stop()`, also when start-up failed half-way.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from benchmarks.hostnet.netns import HostNet
from benchmarks.hostnet.ray_hosts import RayHosts
from benchmarks.hostnet.raypd_hosts import API_KEY, RaypdOnHosts
from pdbench import procs
from pdbench.group import ROOT
from pdbench.raypd_up import RaypdUp
from pdbench.setups import VllmNixlPD

PREFILL_HOST, DECODE_HOST = 1, 2
ROLE_RESOURCES = {"prefill": {"prefill": 1}, "decode": {"decode": 1}, "both": {"engine": 1}}
HOST_RESOURCES = {PREFILL_HOST: {"prefill": 1, "engine": 1}, DECODE_HOST: {"decode": 1, "engine": 1}}


def ucx_env(net: HostNet, host: int) -> dict[str, str]:
    """UCX on TCP over the host's own link: the namespaces share one kernel, and UCX would otherwise
    move KV by CMA or shared memory, which no two real machines can (benchmarks/hostnet/ray_hosts.py)."""
    return {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": net.hosts[host].dev}


def across_hosts_config(src: Path, dst: Path) -> Path:
    """The benchmark's raypd config with every engine group pinned to its host's resource, the front
    on every address (clients come from another host: API key) and the cluster given by --address."""
    cfg = yaml.safe_load(src.read_text())
    for role, res in ROLE_RESOURCES.items():
        if role in cfg:
            cfg[role]["resources"] = res
    cfg["http"] = {**cfg.get("http", {}), "host": "0.0.0.0", "port": 8000}
    cfg["ray"] = {"address": "auto"}
    dst.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return dst


class RaypdAcrossHosts(RaypdUp):
    def __init__(self, settings: dict, model_path: str, run_dir: Path, key: str):
        super().__init__(settings, model_path, run_dir, key)
        self.net: HostNet | None = None
        self.raypd: RaypdOnHosts | None = None
        self.headers = {"Authorization": f"Bearer {API_KEY}"}

    def start(self) -> None:
        cfg = across_hosts_config(ROOT / self.s[self.config_key], self.run_dir / f"{self.setup}-hosts.yaml")
        self.net = HostNet(3).up()
        try:
            ray = RayHosts(self.net, roles=HOST_RESOURCES, num_cpus={0: 2, PREFILL_HOST: 1, DECODE_HOST: 1},
                           extra_env={"RAYPD_API_KEYS": API_KEY}).start()
            self.raypd = RaypdOnHosts(ray, cfg)
            self.raypd.start(timeout_s=self.s["start_timeout_s"])
        except BaseException:
            self.stop()
            raise
        self.log_paths.append(self.raypd.log_path)
        self.url = self.raypd.url
        self.endpoints = {self.setup: self.url}

    def all_pids(self) -> list[int]:
        if self.net is None:
            return []
        return [p for h in range(len(self.net.hosts)) if h not in self.net.lost for p in self.net.pids(h)]

    def log_files(self) -> list[Path]:
        """The head's session logs and the other nodes' (same session name, Ray's default temp dir)."""
        files = list(self.log_paths)
        if self.net is None:
            return files
        head = self.net.workdir / "ray" / "session_latest"
        if head.exists():
            for logs in (head / "logs", Path("/tmp/ray") / head.resolve().name / "logs"):
                if logs.exists():
                    files += [p for p in logs.iterdir() if p.suffix in (".out", ".err", ".log")]
        return files

    def stop(self, grace_s: float = 90.0) -> list[int]:
        seen = self.all_pids()
        if self.raypd is not None:
            self.raypd.stop(grace_s)
            self.raypd = None
        if self.net is not None:
            self.net.down()
            self.net = None
        return sorted(p for p in seen if procs.alive(p))


class VllmNixlPDAcrossHosts(VllmNixlPD):
    PORT, SIDE_PORT = 8100, 5600  # each server alone in its host: fixed ports

    def __init__(self, settings: dict, model_path: str, run_dir: Path):
        super().__init__(settings, model_path, run_dir)
        self.net: HostNet | None = None

    def start(self) -> None:
        self.net = HostNet(3).up()
        try:
            urls = []
            for name, host, core in (("prefill", PREFILL_HOST, "0"), ("decode", DECODE_HOST, "1")):
                h = self.net.hosts[host]
                self.vllm_server(name, core, self.PORT, nixl_side_port=self.SIDE_PORT, host=h.ip, netns=h.netns,
                                 extra_env=ucx_env(self.net, host))
                urls.append(f"http://{h.ip}:{self.PORT}")
            self.wait_ready(urls, self.s["start_timeout_s"])
            front = self.net.hosts[0]
            self.proxy(8000, ["pd", "--prefill", urls[0], "--decode", urls[1]], host=front.ip, netns=front.netns)
            url = f"http://{front.ip}:8000"
            self.wait_ready([url], 60)
        except BaseException:
            self.stop()
            raise
        self.endpoints = {"c": url}

    def stop(self, grace_s: float = 90.0) -> list[int]:
        left = super().stop(grace_s)
        if self.net is not None:
            self.net.down()
            self.net = None
        return [p for p in left if procs.alive(p)]


def make_group(key: str, settings: dict, model_path: str, run_dir: Path):
    if key in ("B", "E"):
        return RaypdAcrossHosts(settings, model_path, run_dir, key)
    if key == "C":
        return VllmNixlPDAcrossHosts(settings, model_path, run_dir)
    raise ValueError(f"no across-hosts set-up for group {key!r}")


def needs_root() -> str | None:
    """Why the hosts cannot be built here (network namespaces need root), or None."""
    return None if os.geteuid() == 0 else "network namespaces need root"
