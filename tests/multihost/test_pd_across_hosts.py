"""P/D across real hosts, run the way docs/multi-node.md tells an operator: three network-namespace
hosts (head with the front and coordinator, a `prefill` node, a `decode` node), Ray token auth on,
`raypd up --config configs/multihost-pd.yaml --address HEAD:6379` on the head, SmolLM2 on vLLM, the
shipped `recompute` policy, the Serve front in its default (HAProxy) mode, clients from outside.

1. KV crosses the wire: the decode host's link receives at least the KV bytes its engine pulled, and
   every engine's NIXL agent publishes its own host's address (never loopback).
2. A P<->D partition while pulls are in flight: every request ends answered, equal to its P/D answer
   from before (recomputed on the decode host), within sync_wait_s + a local prefill's deadline; the
   pair's breaker opens, `/health` stays 200 and says P/D is degraded; after healing the breaker's
   probe puts P/D back, and no lease or block is left held.
"""

from __future__ import annotations

import base64
import json
import socket
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.hostnet.raypd_hosts import RaypdOnHosts
from serving.config import load_config

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "multihost-pd.yaml"
# SmolLM2-135M: 30 layers x 3 KV heads x 64 x (K and V) x float32
KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 4
SLACK_S = 4.0  # what a loaded 2-core host adds (Ray calls, event-loop turns, the SSE's way out)
CITIES = ("Paris", "Rome", "Lyon", "Oslo", "Vienna", "Prague", "Lisbon", "Dublin")
REFERENCES: dict[str, str] = {}  # prompt -> its P/D answer before any fault


def prompt(city: str) -> str:
    return f"The history of the city of {city} begins " + "and the river flows through the old town. " * 40


@pytest.fixture(scope="module")
def raypd(ray_hosts):
    rp = RaypdOnHosts(ray_hosts, CONFIG).start()
    try:
        yield rp
    finally:
        rp.stop()


def engine(status: dict, role: str) -> dict:
    return next(e["stats"] for name, e in status["engines"].items() if name.endswith(f"-{role}-0"))


def test_kv_crosses_the_wire_and_engines_publish_their_hosts_addresses(raypd, host_net):
    for city in CITIES[:3]:
        before_rx = host_net.bytes(2)[0]
        pulled_before = engine(raypd.status(), "decode")["backend"]["counters"]["prompt_tokens_pulled"]
        answer = raypd.complete(prompt(city))
        assert answer.outcome == "completed", answer
        REFERENCES[city] = answer.text
        pulled = engine(raypd.status(), "decode")["backend"]["counters"]["prompt_tokens_pulled"] - pulled_before
        received = host_net.bytes(2)[0] - before_rx
        assert pulled > 300  # the prompt's KV was pulled, not recomputed
        assert received >= pulled * KV_BYTES_PER_TOKEN, (received, pulled * KV_BYTES_PER_TOKEN)

    # each engine's NIXL agent metadata (what its peers connect to) holds its host's address only
    payloads = json.loads(raypd.driver(
        "import json, ray\nfrom actors.ray_names import COORDINATOR_NAME, NAMESPACE\n"
        "ray.init(namespace=NAMESPACE)\nc = ray.get_actor(COORDINATOR_NAME)\n"
        "out = {e.engine_id: [p.decode() for p in ray.get(c.handshake_payloads.remote(e.engine_id, 0, [0]))]"
        " for e in ray.get(c.engines.remote())}\nprint(json.dumps(out))").strip().splitlines()[-1])
    hosts = {"prefill": host_net.hosts[1].ip, "decode": host_net.hosts[2].ip}
    for engine_id, (payload,) in payloads.items():
        role = "prefill" if "-prefill-" in engine_id else "decode"
        metadata = base64.b64decode(json.loads(payload)["body"]["agent_metadata"])
        assert socket.inet_aton(hosts[role]) in metadata, engine_id
        assert socket.inet_aton("127.0.0.1") not in metadata, engine_id
        others = [h.ip for h in host_net.hosts if h.ip != hosts[role]]
        assert not any(socket.inet_aton(ip) in metadata for ip in others), engine_id


@pytest.mark.injects_faults
def test_a_partition_during_pulls_is_recomputed_within_its_bound_then_pd_resumes(raypd, host_net):
    cfg = load_config(CONFIG)
    assert REFERENCES, "needs the P/D answers of the test before"
    bound = cfg.transfer.sync_wait_s + cfg.router.deadline_floor_s + SLACK_S
    pair = next(iter(raypd.status()["breakers"]))

    host_net.partition(1, 2)
    try:
        answers = {city: raypd.complete(prompt(city)) for city in REFERENCES}
        during = raypd.status()
        health = httpx.get(raypd.url + "/health", timeout=10)
    finally:
        host_net.heal()
    assert {c: a.outcome for c, a in answers.items()} == {c: "completed" for c in REFERENCES}
    assert {c: a.text for c, a in answers.items()} == REFERENCES  # recomputed = the P/D answer
    late = {c: round(a.seconds, 1) for c, a in answers.items() if a.seconds > bound}
    assert not late, f"bound {bound} s: {late}"
    assert during["breakers"][pair]["state"] == "open"
    assert health.status_code == 200 and health.json()["code"] == "pd_degraded", health.text

    # healed: after the breaker's cooldown one probe goes P/D, succeeds, and the pair is closed again
    deadline = time.monotonic() + cfg.breaker.cooldown_s + 60
    pulled_before = engine(raypd.status(), "decode")["backend"]["counters"]["kv_pulls"]
    state = None
    while time.monotonic() < deadline:
        city = CITIES[0]
        answer = raypd.complete(prompt(city))
        assert (answer.outcome, answer.text) == ("completed", REFERENCES[city])
        status = raypd.status()
        state = status["breakers"][pair]["state"]
        if state == "closed" and engine(status, "decode")["backend"]["counters"]["kv_pulls"] > pulled_before:
            break
        time.sleep(2)
    assert state == "closed"

    # nothing left held: every lease ended (by notice or by its TTL), every block free
    deadline = time.monotonic() + cfg.transfer.lease_ttl_s + 10
    while time.monotonic() < deadline:
        status = raypd.status()
        held = {r: engine(status, r)["backend"] for r in ("prefill", "decode")}
        if all(b["held_leases"] == 0 and b["free_blocks"] == b["num_blocks"] for b in held.values()) \
                and status["handoffs_in_flight"] == 0:
            break
        time.sleep(2)
    assert all(b["held_leases"] == 0 and b["free_blocks"] == b["num_blocks"] for b in held.values()), held
    assert status["handoffs_in_flight"] == 0
