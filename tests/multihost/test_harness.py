"""The host harness itself: Ray across namespaces moves bytes over the hosts' links, a partition cuts
exactly one pair, a lost host's processes are gone, and teardown leaves no namespace, link, process or
shared-memory file of the run."""

from __future__ import annotations

import time

import pytest

from benchmarks.hostnet.netns import HostNet, leftovers
from benchmarks.hostnet.ray_hosts import RayHosts

pytestmark = pytest.mark.slow

# reached: a TCP answer came back (accepted, or refused where nothing listens); else what failed
CONNECT = ("import socket, sys; s = socket.socket(); s.settimeout(2)\n"
           "try: s.connect((sys.argv[1], 6379)); print('reached')\n"
           "except ConnectionRefusedError: print('reached')\n"
           "except OSError as e: print(type(e).__name__)")


def _reach(net: HostNet, src: int, dst: int) -> str:
    return net.run(src, ["python3", "-c", CONNECT, net.hosts[dst].ip], timeout=20).stdout.strip()


def test_ray_object_crosses_the_link_and_faults_do_what_they_say():
    net = HostNet(3).up()
    run_id = net.run_id
    try:
        rh = RayHosts(net, num_cpus={0: 1, 1: 1, 2: 1}).start()
        before = net.bytes(2)[1]
        out = rh.python(0, "import ray, numpy as np\nray.init()\n"
                           "f = ray.remote(resources={'host2': 1}, num_cpus=0)(lambda: np.ones(2_500_000))\n"
                           "print(ray.get(f.remote()).nbytes)")
        assert out.stdout.split()[-1] == "20000000", out.stderr[-2000:]
        assert net.bytes(2)[1] - before >= 20_000_000  # the 20 MB result left host 2 on its link

        net.partition(1, 2)
        assert (_reach(net, 1, 2), _reach(net, 1, 0), _reach(net, 2, 0)) == ("TimeoutError", "reached", "reached")
        net.heal()
        assert _reach(net, 1, 2) == "reached"

        shm_pids = net.pids(2)
        net.lose(2)
        time.sleep(0.5)
        assert all(not _alive(p) for p in shm_pids)
        assert _reach(net, 1, 0) == "reached"
    finally:
        net.down()
    assert leftovers(run_id) == []


def test_a_run_killed_before_teardown_is_reaped_by_the_next(tmp_path):
    import json
    import subprocess
    import sys

    child = subprocess.run([sys.executable, "-c",
                            "import sys; sys.path.insert(0, '.')\n"
                            "from benchmarks.hostnet.netns import HostNet\n"
                            "net = HostNet(2).up(); print(net.run_id)\n"
                            "import os; os._exit(0)  # dies without its teardown"],
                           capture_output=True, text=True, timeout=60)
    run_id = child.stdout.strip()
    assert leftovers(run_id)  # the dead run left its hosts behind
    net = HostNet(1).up()  # the next run reaps them first
    try:
        assert leftovers(run_id) == []
    finally:
        net.down()
    assert json.dumps(leftovers(net.run_id)) == "[]"


def _alive(pid: int) -> bool:
    """Running or sleeping; a zombie (killed, not yet reaped by its parent) is dead."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
