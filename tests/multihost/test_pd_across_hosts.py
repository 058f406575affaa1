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
3. A capped link: at 1 Gbit/s the pull succeeds and the router learns the pair's rate (`raypd status`
   prints it); at 50 Mbit/s it cannot finish within `transfer.sync_wait_s`, is recomputed within its
   bound and the pair's failure is priced; both answers equal the uncapped ones.
4. The decode host cut past Ray's node-death timeout: its stream ends with an error event within its
   bound, Ray declares the node dead and its raylet exits once healed; the node restarted, the
   decode engine comes back as a new incarnation and answers right, once per host.
5. The prefill host lost (every process killed, the host deleted): requests go on, prefilled on the
   decode host, each equal to its P/D answer; `/health` 200 `pd_degraded` names the lost engine.
"""

from __future__ import annotations

import base64
import json
import socket
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.hostnet.observe import engine_cores, host_processes, node_states
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
    """~390 tokens (~18 MB of KV) that end where the model names the city again. Answers are compared as
    text, and the HTTP API gives no logprobs to accept a near tie by (tests/greedy.py does so on the
    engines), so the greedy answer must have none: over 12 tokens the best token leads the next by at least
    1.78 nats for every city here (vLLM's logprobs, fresh and from the prefix cache). The prompts without
    this ending split at their 3rd and 4th token (0.10 and 0.03 nats), and on CI a prefix-cache hit
    changed an answer. The answer names the city: KV of another prompt would show."""
    return (f"The history of the city of {city} begins " + "and the river flows through the old town. " * 40
            + f"This is the city of {city}. This is the city of {city}. This is the city of")


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


def pulls(status: dict) -> tuple[int, int]:
    """(KV pulls, recomputed pulls) of the decode engine."""
    counters = engine(status, "decode")["backend"]["counters"]
    return counters["kv_pulls"], counters["recomputed"]


@pytest.mark.injects_faults
def test_a_capped_link_pulls_at_its_rate_or_recomputes_within_the_sync_wait(raypd, host_net):
    """1 Gbit/s: the ~18 MB pull takes ~0.15 s and succeeds (no deadline fires), the router learns the
    pair's rate and `raypd status` prints it. 50 Mbit/s: the same pull would take ~2.9 s, past
    `transfer.sync_wait_s` (2 s) that holds the decode step: it is failed there, the prompt recomputed on
    the decode host (the answer equal to the uncapped one), and the router prices the pair's failure."""
    cfg = load_config(CONFIG)
    pair, breaker = next(iter(raypd.status()["breakers"].items()))
    assert breaker["state"] == "closed", breaker  # P/D again after the partition (the test before)
    answers = {}
    try:
        host_net.cap(2, "1gbit")
        before = pulls(raypd.status())
        answers["1gbit"] = raypd.complete(prompt("Bergen"))
        status = raypd.status()
        assert pulls(status) == (before[0] + 1, before[1])  # pulled, not recomputed
        rate = status["serve"]["router"]["pull_rates"][pair]
        assert rate["failure_penalty_s"] == 0.0, rate
        assert f"learned pull {pair}" in raypd.status(as_json=False)

        host_net.cap(2, "50mbit")
        before = pulls(status)
        answers["50mbit"] = raypd.complete(prompt("Turin"))
        status = raypd.status()
    finally:
        host_net.heal()
    assert pulls(status) == (before[0] + 1, before[1] + 1)  # the pull failed its sync wait: recomputed
    assert status["serve"]["router"]["pull_rates"][pair]["failure_penalty_s"] > cfg.transfer.sync_wait_s
    assert answers["50mbit"].seconds < cfg.transfer.sync_wait_s + cfg.router.deadline_floor_s + SLACK_S

    # the same prompts over the healed link: the capped answers were right
    for city, cap in (("Bergen", "1gbit"), ("Turin", "50mbit")):
        again = raypd.complete(prompt(city))
        assert (answers[cap].outcome, answers[cap].text) == ("completed", again.text), (cap, answers[cap], again)


@pytest.mark.injects_faults
def test_the_decode_host_cut_past_rays_node_timeout_ends_its_stream_and_runs_its_engine_once(
        raypd, ray_hosts, host_net):
    """The decode host loses every link until Ray declares its node dead (the module's Ray gives up on
    a node after 10 failed checks a second apart: conftest's FAST_NODE_DEATH). The stream caught in
    the cut got its first token from the prefill host and no other engine can decode it: it ends with
    an SSE error event within its first-chunk deadline (floor + margin x its prefill + the pull's read
    timeout) and the migration wait. Healed, the cut raylet learns that its node is dead and exits, and
    its workers with it (Ray's own fence); the host's node is started again, as KubeRay restarts a pod;
    the launcher starts the decode engine there as a new incarnation, and the next answers equal their
    P/D answers. One vLLM engine core per host afterwards: no engine runs twice."""
    cfg = load_config(CONFIG)
    assert REFERENCES, "needs the P/D answers of the first test"
    bound = (cfg.router.deadline_floor_s + cfg.transfer.read_timeout_s + cfg.router.migration_wait_s
             + 2 * SLACK_S)
    decode_ip = host_net.hosts[2].ip
    generation = engine(raypd.status(), "decode")["generation"]

    host_net.cut(2)
    t_cut, declared_dead_s = time.monotonic(), None
    try:
        caught = raypd.complete(prompt(CITIES[4]))
        while declared_dead_s is None and time.monotonic() - t_cut < 120:
            if node_states(ray_hosts).get(decode_ip) is False:
                declared_dead_s = round(time.monotonic() - t_cut, 1)
            else:
                time.sleep(2)
    finally:
        host_net.heal()
    assert caught.outcome == "error_event" and caught.first_s is not None, caught
    assert caught.seconds < bound, (caught, bound)
    assert declared_dead_s is not None, "Ray never declared the cut host's node dead"

    deadline = time.monotonic() + 60
    while "raylet" in host_processes(host_net, 2) and time.monotonic() < deadline:
        time.sleep(1)
    assert "raylet" not in host_processes(host_net, 2)  # Ray fenced the node it declared dead
    ray_hosts.restart_node(2)
    t_restart, answer = time.monotonic(), None
    while time.monotonic() - t_restart < 240:
        answer = raypd.complete(prompt(CITIES[0]))
        if answer.outcome == "completed":
            break
        assert answer.outcome == "http_error", answer  # no decode engine yet: refused at once
        time.sleep(3)
    back_s = time.monotonic() - t_restart
    assert (answer.outcome, answer.text) == ("completed", REFERENCES[CITIES[0]]), answer
    assert engine(raypd.status(), "decode")["generation"] > generation
    assert {h: engine_cores(host_net, h) for h in (1, 2)} == {1: 1, 2: 1}
    print(f"decode host cut: caught stream ended in {caught.seconds:.1f} s, node declared dead after "
          f"{declared_dead_s} s, first good answer {back_s:.1f} s after the node restarted")


@pytest.mark.injects_faults
def test_the_prefill_host_lost_serving_goes_on_colocated_and_health_says_why(raypd, host_net):
    """Every process of the prefill host SIGKILLed and the host deleted (last in this module: the host
    stays gone). Requests go on, prefilled on the decode host (`no_prefill_fallback: decode_local`),
    each equal to its P/D answer; `/health` stays 200 with code `pd_degraded`, naming the lost engine."""
    assert REFERENCES, "needs the P/D answers of the first test"
    host_net.lose(1)
    t_loss = time.monotonic()
    answers = {city: raypd.complete(prompt(city)) for city in REFERENCES}
    assert {c: (a.outcome, a.text) for c, a in answers.items()} == {
        c: ("completed", text) for c, text in REFERENCES.items()}, {c: a for c, a in answers.items()}
    served_s = time.monotonic() - t_loss
    health = httpx.get(raypd.url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["code"] == "pd_degraded", health.text
    assert "raypd-multihost-pd-prefill-0" in health.json()["reason"], health.text
    print(f"prefill host lost: {len(answers)} requests answered right within {served_s:.1f} s")
