"""What Ray and raypd did on the hosts, read from outside: each host's processes, the head's view of
nodes and placement groups over time, and the control plane's own records (the coordinator's engine
events, the launcher's node-loss steps). Every read is a bounded driver run on a host."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import yaml

from .netns import HostNet
from .ray_hosts import RayHosts
from .raypd_hosts import RaypdOnHosts

ROOT = Path(__file__).resolve().parents[2]


def ray_timeline(rh: RayHosts, stop: threading.Event, t0: float, out: list) -> None:
    """Every ~5 s until `stop`: the nodes' liveness and the engines' placement groups as the head sees
    them, kept where they changed (seconds since `t0`): where an engine's return spends its time."""
    code = ("import json, ray; ray.init(); groups = {};"
            "[groups.setdefault(v['name'], []).append(v.get('state')) for v in "
            "ray.util.placement_group_table().values() if v.get('name')];"  # every group of a name: old ones too
            "print(json.dumps({'nodes': {n['NodeManagerAddress']: n['Alive'] for n in "
            "sorted(ray.nodes(), key=lambda n: n.get('Alive'))}, 'groups': {k: sorted(v) for k, v in groups.items()}}))")
    last = None
    while not stop.is_set():
        r = rh.python(0, code, timeout=60)
        try:
            snap = json.loads(r.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            snap = {"error": (r.stderr or "")[-200:]}
        if snap != last:
            out.append({"t": round(time.monotonic() - t0, 1), **snap})
            last = snap
        stop.wait(5)


def control_events(rh: RayHosts, rp: RaypdOnHosts, since: float, t0: float) -> list[dict]:
    """The coordinator's engine events and the launcher's node-loss steps after `since` (wall clock),
    in seconds from `t0`: who killed, restarted or started which incarnation when."""
    name = yaml.safe_load(rp.config.read_text())["name"]
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); import ray; ray.init(namespace='raypd');"
            "from serving.cluster.names import launcher_name; from actors.ray_names import COORDINATOR_NAME;"
            f"l = ray.get_actor(launcher_name({name!r})); c = ray.get_actor(COORDINATOR_NAME);"
            "ev = [dict(t=e.t, source='launcher', engine=e.engine, step=e.step, detail=e.detail)"
            " for e in ray.get(l.node_loss_events.remote())];"
            "ev += [dict(t=e['t'], source='coordinator', engine=e.get('engine_id'), step=e['event'],"
            " detail=str({k: v for k, v in e.items() if k not in ('t', 'event', 'engine_id')})[:240])"
            " for e in ray.get(c.recent_events.remote(200))];"
            "print(json.dumps(ev))")
    r = rh.python(0, code, timeout=60)
    try:
        events = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return [{"t": None, "source": "error", "detail": (r.stderr or "")[-300:]}]
    return [{**e, "t": round(e["t"] - t0, 1)} for e in sorted(events, key=lambda e: e["t"]) if e["t"] >= since]


def host_processes(net: HostNet, host: int) -> list[str]:
    """The host's processes by name (Ray and vLLM titles; `raylet`, `gcs_server` by their command)."""
    names = []
    for pid in net.pids(host):
        try:
            first = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        names.append(first[:48] if first.startswith(("ray::", "VLLM::")) else Path(first).name[:48])
    return sorted(names)


def engine_cores(net: HostNet, host: int) -> int:
    """How many vLLM engine cores run on the host (one per engine it should run: none run twice)."""
    return sum(p.startswith("VLLM::EngineCore") for p in host_processes(net, host))


def node_states(rh: RayHosts) -> dict[str, bool]:
    """Node address -> alive, in the head's view (the newest entry per address)."""
    code = ("import json, ray; ray.init(); ns = sorted(ray.nodes(), key=lambda n: n.get('Alive'));"
            "print(json.dumps({n['NodeManagerAddress']: n['Alive'] for n in ns}))")
    out = rh.python(0, code, timeout=60)
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {}
