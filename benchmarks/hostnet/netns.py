"""Hosts as network namespaces on one bridge: build them, break their links, measure them, remove them.

Life cycle of one run (`HostNet`):
1. `up()` first reaps what earlier runs left behind when their process died (their state file names
   a dead pid), then makes a bridge, n namespaces with a veth `eth0` each at 198.18.<net>.<i+1>/24,
   and gives the bridge .254 so that this namespace reaches every host (the test's HTTP client).
2. Faults: `partition(a, b)` isolates the two hosts' bridge ports from each other (the bridge drops
   their frames silently, as a failed switch path would, while both still reach every other host);
   `cut(h)` takes a host's link down; `cap(h, rate)` puts tbf on both ends of its link; `lose(h)`
   SIGKILLs every process in the namespace and deletes it. `heal()` undoes partitions, cuts and caps.
3. `down()` SIGKILLs every process of every namespace, deletes the namespaces and the bridge, and
   removes the /dev/shm files that appeared during the run and that no live process holds.
Names carry the run's id, so two runs never share a namespace, a link or an address.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

STATE_DIR = Path("/tmp/raypd-hostnet")  # one JSON file per live run: what `reap_stale` may remove
SHM = Path("/dev/shm")


class HostNetError(RuntimeError):
    """A namespace operation failed (the command and its stderr are in the message)."""


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise HostNetError(f"{' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc


@dataclass(frozen=True)
class Host:
    """One host: its namespace, its address and its link (`eth0` inside, `port` on the bridge)."""
    index: int
    netns: str
    ip: str
    port: str
    dev: str = "eth0"


@dataclass
class HostNet:
    """A run's hosts. Not thread-safe: one owner (the fixture, the benchmark or the CLI)."""
    count: int
    run_id: str = field(default_factory=lambda: f"{random.randrange(16 ** 4):04x}")
    net: int = field(default_factory=lambda: random.randrange(1, 255))  # 198.18.<net>.0/24
    hosts: list[Host] = field(default_factory=list)
    lost: set[int] = field(default_factory=set)
    _shm_before: set[str] = field(default_factory=set)

    @property
    def bridge(self) -> str:
        return f"rpdb{self.run_id}"

    @property
    def workdir(self) -> Path:
        """The run's files (Ray's temp dir, tokens, logs): short, since Ray's unix sockets live below."""
        return Path(f"/tmp/rpdh{self.run_id}")

    @property
    def gateway(self) -> str:
        """This (root) namespace's address on the bridge."""
        return f"198.18.{self.net}.254"

    def up(self) -> "HostNet":
        reap_stale()
        self._shm_before = set(os.listdir(SHM))
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        self.hosts = [Host(i, f"rpd-{self.run_id}-h{i}", f"198.18.{self.net}.{i + 1}", f"rpd{self.run_id}p{i}")
                      for i in range(self.count)]
        self._write_state()  # before the first object exists: an interrupted build is reaped too
        try:
            sh("ip", "link", "add", self.bridge, "type", "bridge")
            sh("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            sh("ip", "link", "set", self.bridge, "up")
            for h in self.hosts:
                sh("ip", "netns", "add", h.netns)
                sh("ip", "link", "add", h.port, "type", "veth", "peer", "name", h.dev, "netns", h.netns)
                sh("ip", "link", "set", h.port, "master", self.bridge)
                sh("ip", "link", "set", h.port, "up")
                sh("ip", "-n", h.netns, "addr", "add", f"{h.ip}/24", "dev", h.dev)
                sh("ip", "-n", h.netns, "link", "set", h.dev, "up")
                sh("ip", "-n", h.netns, "link", "set", "lo", "up")
        except BaseException:
            self.down()
            raise
        return self

    # -- running things on a host ------------------------------------------------------------

    def command(self, host: int, argv: list[str]) -> list[str]:
        """argv run inside host's namespace (its children stay there: `lose` and `down` find them)."""
        return ["ip", "netns", "exec", self.hosts[host].netns, *argv]

    def popen(self, host: int, argv: list[str], env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        return subprocess.Popen(self.command(host, argv), env=env, start_new_session=True, **kw)

    def run(self, host: int, argv: list[str], env: dict[str, str] | None = None,
            timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(host, argv), env=env, capture_output=True, text=True, timeout=timeout)

    def pids(self, host: int) -> list[int]:
        out = sh("ip", "netns", "pids", self.hosts[host].netns, check=False).stdout
        return [int(p) for p in out.split()]

    # -- faults ------------------------------------------------------------------------------

    def partition(self, a: int, b: int) -> None:
        """a and b lose each other; both still reach every other host. Bridge ports marked isolated
        forward only to ports that are not: exactly a<->b is cut when only their two are isolated."""
        for h in (a, b):
            sh("ip", "link", "set", "dev", self.hosts[h].port, "type", "bridge_slave", "isolated", "on")

    def cut(self, host: int) -> None:
        """The host loses every link (its processes live on, unreachable)."""
        sh("ip", "link", "set", self.hosts[host].port, "down")

    def cap(self, host: int, rate: str, burst: str = "256kb") -> None:
        """Bandwidth cap (tbf, e.g. "50mbit") on both directions of the host's link."""
        h = self.hosts[host]
        sh("tc", "qdisc", "replace", "dev", h.port, "root", "tbf", "rate", rate, "burst", burst, "latency", "50ms")
        sh("ip", "netns", "exec", h.netns, "tc", "qdisc", "replace", "dev", h.dev, "root", "tbf",
           "rate", rate, "burst", burst, "latency", "50ms")

    def heal(self) -> None:
        """Every partition, cut and cap undone (lost hosts stay lost)."""
        for h in self.hosts:
            if h.index in self.lost:
                continue
            sh("ip", "link", "set", "dev", h.port, "type", "bridge_slave", "isolated", "off")
            sh("ip", "link", "set", h.port, "up")
            sh("tc", "qdisc", "del", "dev", h.port, "root", check=False)
            sh("ip", "netns", "exec", h.netns, "tc", "qdisc", "del", "dev", h.dev, "root", check=False)
            sh("ip", "-n", h.netns, "neigh", "flush", "dev", h.dev, check=False)  # ARP failed while cut

    def lose(self, host: int) -> None:
        """The host is gone: every process in it SIGKILLed, then its namespace deleted."""
        _kill_all(self.hosts[host].netns)
        sh("ip", "netns", "del", self.hosts[host].netns, check=False)
        self.lost.add(host)

    # -- measuring ---------------------------------------------------------------------------

    def bytes(self, host: int) -> tuple[int, int]:
        """(received, sent) bytes on the host's eth0 since it was made."""
        h = self.hosts[host]
        read = self.run(host, ["cat", f"/sys/class/net/{h.dev}/statistics/rx_bytes",
                               f"/sys/class/net/{h.dev}/statistics/tx_bytes"], timeout=10)
        rx, tx = read.stdout.split()
        return int(rx), int(tx)

    # -- teardown ----------------------------------------------------------------------------

    def down(self, wait_s: float = 10) -> None:
        """Remove everything of the run; waits (bounded) until the kernel has let go of its links."""
        _remove(self.bridge, [h.netns for h in self.hosts], self._shm_before, [h.port for h in self.hosts])
        shutil.rmtree(self.workdir, ignore_errors=True)
        deadline = time.monotonic() + wait_s
        while leftovers(self.run_id) and time.monotonic() < deadline:
            time.sleep(0.1)
        (STATE_DIR / f"{self.run_id}.json").unlink(missing_ok=True)

    def _write_state(self) -> None:
        state = {"pid": os.getpid(), "started": _start_time(os.getpid()), "bridge": self.bridge,
                 "namespaces": [h.netns for h in self.hosts], "ports": [h.port for h in self.hosts],
                 "shm_before": sorted(self._shm_before)}
        (STATE_DIR / f"{self.run_id}.json").write_text(json.dumps(state))


def leftovers(run_id: str) -> list[str]:
    """What of a run still exists (namespaces, links, processes in them): [] after a clean teardown."""
    found = [n for n in sh("ip", "netns", "list").stdout.split() if f"rpd-{run_id}-" in n]
    found += [ln for ln in sh("ip", "-o", "link", "show").stdout.splitlines() if f"rpd{run_id}p" in ln
              or f"rpdb{run_id}" in ln]
    return found


def reap_stale() -> list[str]:
    """Remove the runs whose owning process is gone (a run killed before its teardown)."""
    reaped = []
    if not STATE_DIR.exists():
        return reaped
    for path in STATE_DIR.glob("*.json"):
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError):
            path.unlink(missing_ok=True)
            continue
        if _start_time(state["pid"]) == state.get("started"):
            continue  # its owner still runs
        _remove(state["bridge"], state["namespaces"], set(state.get("shm_before", ())), state.get("ports", []))
        shutil.rmtree(f"/tmp/rpdh{path.stem}", ignore_errors=True)
        path.unlink(missing_ok=True)
        reaped.append(path.stem)
    return reaped


def _remove(bridge: str, namespaces: list[str], shm_before: set[str], ports: list[str]) -> None:
    existing = set(sh("ip", "netns", "list", check=False).stdout.split())
    for ns in namespaces:
        if ns in existing:
            _kill_all(ns)
    for ns in namespaces:
        if ns in existing:
            sh("ip", "netns", "del", ns, check=False)
    for port in ports:  # the namespace's end goes with it, but only once the kernel frees the namespace
        sh("ip", "link", "del", port, check=False)
    sh("ip", "link", "del", bridge, check=False)
    _remove_orphan_shm(shm_before)


def _kill_all(netns: str, rounds: int = 20) -> None:
    """SIGKILL every process in the namespace until none is left (a dying raylet's children may
    still be forking for a moment); bounded."""
    for _ in range(rounds):
        pids = [int(p) for p in sh("ip", "netns", "pids", netns, check=False).stdout.split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
    raise HostNetError(f"processes still alive in {netns} after {rounds} SIGKILL rounds")


def _remove_orphan_shm(before: set[str]) -> None:
    """Shared-memory files born during the run that no live process maps or holds open."""
    new = set(os.listdir(SHM)) - before
    if not new:
        return
    held: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            held.update(os.path.basename(os.readlink(fd)) for fd in (proc / "fd").iterdir()
                        if os.readlink(fd).startswith("/dev/shm/"))
            held.update(line.rsplit("/", 1)[-1].split(" ")[0] for line in (proc / "maps").read_text().splitlines()
                        if "/dev/shm/" in line)
        except (OSError, ValueError):
            continue
    for name in new - held:
        try:
            (SHM / name).unlink()
        except (IsADirectoryError, PermissionError, FileNotFoundError):
            pass


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None
