"""Ray's own processes sized for a serving node.

Ray's defaults suit an interactive cluster (a dashboard that shows every task, node statistics every
few seconds, a Serve controller that reconciles ten times a second); on a serving node those
processes share the cores with the engines and none of their work is per request.
`SERVING_NODE_ENV` is what raypd changes, each value a default only (a variable already set wins);
`RAYPD_RAY_PROFILE=ray` keeps Ray's own. `init_ray` applies it before it starts a local cluster; a
cluster started elsewhere (`ray start`, KubeRay) gets it from its own environment (the RayService
manifests set the same variables; a unit test keeps them equal). What each variable costs you, and
what the profile saves: docs/operations.md.
"""

from __future__ import annotations

import os
import random
import socket
from collections.abc import MutableMapping

PROFILE_ENV = "RAYPD_RAY_PROFILE"  # "serving" (the default) or "ray" (Ray's own defaults)
PROFILES = ("serving", "ray")

SERVING_NODE_ENV: dict[str, str] = {
    "RAY_task_events_report_interval_ms": "0",  # no task events (`ray list tasks`, timelines empty)
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",  # Serve reconciles every 0.5 s, not 0.1 s
    "REPORTER_UPDATE_INTERVAL_MS": "30000",  # node and process statistics every 30 s, not 5 s
    # the log monitor looks for new log files every 5 s instead of globbing every 0.1 s (none is lost)
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
    "LOG_NAME_UPDATE_INTERVAL_S": "5",
    # Serve's HAProxy mode: HAProxy forwards each connection to an ingress replica's own HTTP server,
    # instead of Serve's Python proxy relaying every response message as a Ray item
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    # a stopping ingress replica stays up 2 s (Ray's 30) for HAProxy to take it out of its servers
    # (`serve.shutdown()` waits for it: with 30 s it outlived its own 30 s deadline)
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
}
# HAProxy's listeners besides the front's, on every interface (statistics page, Prometheus exporter):
# a local cluster gets free ports from HAPROXY_PORT_RANGE (two clusters on one host must not ask for
# the same; Ray's processes take theirs from the ephemeral range, Serve's replicas 30000 and up); a
# RayService's pods keep Ray's 8404 and 9101
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
