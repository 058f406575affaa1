"""raypd across real hosts (network namespaces, `benchmarks/hostnet/`): P/D over the wire, and what each
network fault costs a request, measured from the client.

Deployment A (`configs/multihost-pd.yaml`: prefill on host 1, decode on host 2, every request pulled):
  healthy      P/D answers (the references), KV bytes on the decode host's link against the pulled KV
  partition    P<->D cut (both still reach the head): each request's terminal outcome and time, the
               breaker, /health; after healing, the time until a request pulls again
  capped link  tbf on the decode host's link at 1 Gbit/s and 50 Mbit/s: TTFT, first->second token, total
  host cut     the decode host loses every link for longer than Ray's node-death timeout: what Ray and
               raypd did, and what a request sees during and after
Deployment B (`configs/multihost-default.yaml`: two `both` engines, SLO placement):
  slow link    50 Mbit/s on host 2, ~1.5k-token prompts 4 in flight, `--rounds` rounds: decisions, the
               pull rates learned, first->second token gaps and totals
  host lost    host 2's processes killed: the streams in flight, then colocated serving and /health
               (only when B runs last)
Deployment C (B with `router.placement: colocate`, no KV pulled): the same rounds on the same link,
  the colocated baseline; B's rounds that began with every pair's pull learned (each direction learns
  from its own first pull) are compared with every round of C, means and medians (`--deployments
  C,B,C`: C before and after B, in alternating order)

    sudo .venv/bin/python benchmarks/hosts_faults.py [--out benchmarks/results/hosts_faults.txt]
    # the slow link alone, B between two runs of its colocated baseline:
    sudo .venv/bin/python benchmarks/hosts_faults.py --deployments C,B,C --rounds 5 --out benchmarks/results/hosts_slow_link.txt
    # a cut past Ray's node death detection, deployment A only:
    sudo .venv/bin/python benchmarks/hosts_faults.py --cut-s 120 --deployments A --out benchmarks/results/hosts_cut_long.txt
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import yaml  # noqa: E402

from benchmarks.hostnet.netns import HostNet, leftovers  # noqa: E402
from benchmarks.hostnet.observe import (control_events, engine_cores, host_processes, node_states,  # noqa: E402
                                       ray_timeline)
from benchmarks.hostnet.ray_hosts import RayHosts  # noqa: E402
from benchmarks.hostnet.raypd_hosts import API_KEY, Answer, RaypdOnHosts  # noqa: E402

KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 4  # SmolLM2-135M, float32
SHORT = "and the river flows through the old town. " * 40  # ~370 tokens
LONG = "and the river flows through the old town. " * 160  # ~1.5k tokens
CITIES = ("Paris", "Rome", "Lyon", "Oslo", "Vienna", "Prague", "Lisbon", "Dublin", "Bergen", "Turin")


def prompt(city: str, body: str = SHORT) -> str:
    return f"The history of the city of {city} begins {body}"


def row(name: str, a: Answer, ref: str | None = None) -> dict:
    return {"request": name, "outcome": a.outcome, "right": None if ref is None else a.text == ref,
            "text": a.text, "reference": ref,
            "seconds": round(a.seconds, 3), "ttft_s": a.first_s and round(a.first_s, 3),
            "first_to_second_s": round(a.second_s - a.first_s, 3) if a.first_s and a.second_s else None}


def counters(rp: RaypdOnHosts, role: str) -> dict:
    stats = next(e["stats"] for n, e in rp.status()["engines"].items() if f"-{role}-" in n)
    return stats["backend"]["counters"]


def deployment_a(net: HostNet, rh: RayHosts, out: dict, cut_s: float = 45) -> None:
    rp = RaypdOnHosts(rh, ROOT / "configs" / "multihost-pd.yaml")
    t0 = time.monotonic()
    rp.start()
    out["A_start_s"] = round(time.monotonic() - t0, 1)
    refs: dict[str, str] = {}
    healthy = []
    for city in CITIES[:4]:
        rx0, pulled0 = net.bytes(2)[0], counters(rp, "decode")["prompt_tokens_pulled"]
        a = rp.complete(prompt(city))
        refs[city] = a.text
        pulled = counters(rp, "decode")["prompt_tokens_pulled"] - pulled0
        healthy.append({**row(city, a), "kv_bytes_pulled": pulled * KV_BYTES_PER_TOKEN,
                        "link_bytes_received": net.bytes(2)[0] - rx0})
    out["A_healthy"] = healthy

    pair = next(iter(rp.status()["breakers"]))
    net.partition(1, 2)
    t_fault = time.monotonic()
    part = [row(c, rp.complete(prompt(c)), refs[c]) for c in CITIES[:4]]
    status, health = rp.status(), httpx.get(rp.url + "/health", timeout=10).json()
    net.heal()
    t_heal = time.monotonic()
    resumed = None
    pulls0 = counters(rp, "decode")["kv_pulls"]
    while time.monotonic() - t_heal < 90:
        a = rp.complete(prompt(CITIES[0]))
        if counters(rp, "decode")["kv_pulls"] > pulls0 and a.text == refs[CITIES[0]]:
            resumed = round(time.monotonic() - t_heal, 1)
            break
        time.sleep(1)
    out["A_partition"] = {"requests": part, "fault_to_last_outcome_s": round(t_heal - t_fault, 1),
                          "breaker_during": status["breakers"][pair]["state"], "health_during": health.get("code"),
                          "pd_resumed_after_heal_s": resumed}

    long_refs: dict[str, str] = {}
    caps = {}
    for cap in (None, "1gbit", "50mbit"):
        if cap:
            net.cap(2, cap)
        rows = []
        for city in CITIES[4:7]:
            a = rp.complete(prompt(city, LONG), max_tokens=8, timeout_s=180)
            long_refs.setdefault(city, a.text)
            rows.append(row(city, a, long_refs[city]))
        caps[cap or "uncapped"] = rows
        net.heal()
    out["A_capped"] = caps

    # the decode host cut off from everyone for longer than Ray's node health checks allow
    out["A_host_cut"] = host_cut(net, rh, rp, refs, cut_s)
    rp.stop()


def deployment_b(net: HostNet, rh: RayHosts, out: dict, rounds: int = 3, lose_host: bool = True) -> None:
    rp = RaypdOnHosts(rh, ROOT / "configs" / "multihost-default.yaml")
    t0 = time.monotonic()
    rp.start()
    out["B_start_s"] = round(time.monotonic() - t0, 1)
    out["B_slow_link"] = slow_link_rounds(net, rp, rounds)
    if not lose_host:  # another deployment follows on these hosts
        rp.stop()
        return

    with ThreadPoolExecutor(2) as pool:
        inflight = [pool.submit(rp.complete, prompt(c, SHORT), 64) for c in CITIES[:2]]
        time.sleep(3)
        t_loss = time.monotonic()
        net.lose(2)
        lost_rows = [row(f"in-flight-{i}", f.result()) for i, f in enumerate(inflight)]
    after = [row(c, rp.complete(prompt(c))) for c in CITIES[2:5]]
    out["B_host_lost"] = {"in_flight": lost_rows, "after": after,
                          "loss_to_last_in_flight_outcome_s": round(time.monotonic() - t_loss, 1),
                          "health_after": httpx.get(rp.url + "/health", timeout=10).json()}
    rp.stop()


def deployment_c(net: HostNet, rh: RayHosts, out: dict, rounds: int = 3) -> None:
    """B's engines with placement `colocate`: the baseline of B's slow-link rounds (run before and
    after B when asked twice: its rounds are pooled)."""
    cfg = yaml.safe_load((ROOT / "configs" / "multihost-default.yaml").read_text())
    cfg["name"], cfg["router"] = cfg["name"] + "-colocate", {**cfg.get("router", {}), "placement": "colocate"}
    path = rh.workdir / "multihost-colocate.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rp = RaypdOnHosts(rh, path)
    t0 = time.monotonic()
    rp.start()
    out["C_start_s"] = round(time.monotonic() - t0, 1)
    out.setdefault("C_slow_link", {"rounds": []})["rounds"] += slow_link_rounds(net, rp, rounds)["rounds"]
    rp.stop()


def slow_link_rounds(net: HostNet, rp: RaypdOnHosts, rounds: int = 3, per_round: int = 16,
                     in_flight: int = 4) -> dict:
    """Host 2's link at 50 Mbit/s; per round `per_round` fresh ~1.5k-token prompts (no shared prefix),
    `in_flight` at a time: each request's outcome, TTFT, first->second gap and total, the round's
    placement decisions and the pull rates the router learned by its end; `pairs`: every pair that
    placement may pull over (its breakers)."""
    net.cap(2, "50mbit")
    out, pairs = [], sorted(rp.status()["breakers"])
    try:
        for r in range(rounds):
            before, pulls0 = _decisions(rp), _pulls(rp)
            names = [f"{CITIES[i % len(CITIES)]}-{r}-{i}" for i in range(per_round)]
            with ThreadPoolExecutor(in_flight) as pool:
                answers = list(pool.map(lambda n: rp.complete(prompt(n, LONG), max_tokens=32, timeout_s=240), names))
            after, pulls = _decisions(rp), _pulls(rp)
            out.append({"requests": [row(n, a) for n, a in zip(names, answers)],
                        "decisions": {k: v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)},
                        "pulls": {k: pulls[k] - pulls0[k] for k in pulls},
                        "learned_pull_rates": rp.status()["serve"]["router"].get("pull_rates")})
    finally:
        net.heal()
    return {"rounds": out, "pairs": pairs}


def _pulls(rp: RaypdOnHosts) -> dict[str, int]:
    """KV pulls and recomputed (failed) pulls, summed over the engines."""
    found = [e["stats"]["backend"]["counters"] for e in rp.status()["engines"].values() if e.get("stats")]
    return {k: sum(c.get(k, 0) for c in found) for k in ("kv_pulls", "recomputed")}


def _decisions(rp: RaypdOnHosts) -> dict[str, int]:
    return dict((rp.status()["serve"]["router"].get("planner") or {}).get("decisions", {}))


def host_cut(net: HostNet, rh: RayHosts, rp: RaypdOnHosts, refs: dict[str, str], cut_s: float = 45) -> dict:
    """Host 2 loses every link for `cut_s` (past Ray's node health checks: ~30 s), then is healed. What
    Ray did (each node alive or dead, during and after), what happened to the processes of the host,
    what a request saw; then, where Ray declared the node dead (its raylet exits once it can talk
    again), the node is started again, as KubeRay restarts a pod, and the time to the first good answer
    is measured. Every wait is bounded."""
    gen0 = {n: e["stats"]["generation"] for n, e in rp.status()["engines"].items()}
    net.cut(2)
    t_cut = time.monotonic()
    during = row("during-cut", rp.complete(prompt(CITIES[7])), None)
    time.sleep(max(0.0, cut_s - (time.monotonic() - t_cut)))
    nodes_during = node_states(rh)
    net.heal()
    t_heal, wall_heal = time.monotonic(), time.time()
    time.sleep(15)  # a raylet that Ray declared dead exits when it next reaches the GCS
    host2_after_heal = host_processes(net, 2)
    nodes_after_heal = node_states(rh)
    restarted_node_s = None
    if nodes_after_heal.get(net.hosts[2].ip) is not True and not any(
            "raylet" in p for p in host2_after_heal):
        rh.restart_node(2)  # as KubeRay restarts the pod of a node Ray gave up on
        restarted_node_s = round(time.monotonic() - t_heal, 1)
    first_good, after, timeline, stop = None, [], [], threading.Event()
    watch = threading.Thread(target=ray_timeline, args=(rh, stop, t_heal, timeline), daemon=True)
    watch.start()
    try:
        while time.monotonic() - t_heal < 240:
            a = rp.complete(prompt(CITIES[0]))
            after.append({**row("after-heal", a, refs[CITIES[0]]), "sent_after_heal_s": round(
                time.monotonic() - t_heal - a.seconds, 1)})
            if a.outcome == "completed" and a.text == refs[CITIES[0]]:
                first_good = round(time.monotonic() - t_heal, 1)
                break
            time.sleep(3)
    finally:
        stop.set()
        watch.join(timeout=90)
    status = rp.status()
    engines_after = {n: {"healthy": e.get("healthy"), "generation": (e.get("stats") or {}).get("generation")}
                     for n, e in status["engines"].items()}
    cores = {h: engine_cores(net, h) for h in (1, 2)}
    return {"cut_s": cut_s, "request_during_cut": during, "ray_nodes_during": nodes_during,
            "host2_processes_15s_after_heal": host2_after_heal, "ray_nodes_15s_after_heal": nodes_after_heal,
            "node_restarted_after_heal_s": restarted_node_s, "ray_nodes_after": node_states(rh),
            "generations_before": gen0, "engines_after": engines_after, "engine_cores_per_host_after": cores,
            "first_good_answer_after_heal_s": first_good, "requests_after_heal": after[-5:],
            "ray_timeline_after_heal": timeline,
            "control_events": control_events(rh, rp, wall_heal - cut_s - 5, wall_heal)}










def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "hosts_faults.txt"))
    ap.add_argument("--cut-s", type=float, default=45, help="how long the decode host is cut off")
    ap.add_argument("--deployments", default="A,C,B", help="A (1P+1D), B (the default's shape), C (B colocated), "
                    "run in this order (A first); C may come twice (C,B,C: B's baseline before and after it); "
                    "B loses host 2 at its end only when it comes last")
    ap.add_argument("--rounds", type=int, default=3, help="slow-link rounds per run of B or C (B's first learns)")
    args = ap.parse_args()
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    out: dict = {"commit": commit, "dirty": bool(dirty), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    net = HostNet(3).up()
    try:
        rh = RayHosts(net, roles={1: {"prefill": 1, "engine": 1}, 2: {"decode": 1, "engine": 1}},
                      num_cpus={0: 2, 1: 1, 2: 1}, extra_env={"RAYPD_API_KEYS": API_KEY}).start()
        chosen = args.deployments.split(",")
        if "A" in chosen:
            deployment_a(net, rh, out, args.cut_s)
        rest = [d for d in chosen if d != "A"]
        for i, d in enumerate(rest):
            if 2 in net.lost:
                raise RuntimeError(f"host 2 gone before deployment {d}")
            if d == "C":
                deployment_c(net, rh, out, args.rounds)
            elif d == "B":
                deployment_b(net, rh, out, args.rounds, lose_host=i == len(rest) - 1)
    except Exception as exc:  # noqa: BLE001 - what was measured is written, with why the rest was not
        out["aborted"] = f"{type(exc).__name__}: {str(exc)[-1500:]}"
    finally:
        net.down()
        out["teardown_leftovers"] = leftovers(net.run_id)
    Path(args.out).with_suffix(".json").write_text(json.dumps(out, indent=1))
    Path(args.out).write_text(report(out))
    print(report(out))
    return 1 if out.get("aborted") else 0


def report(o: dict) -> str:
    lines = [f"# hosts_faults.py  commit {o['commit'][:12]}{' (dirty)' if o['dirty'] else ''}  {o['date']}",
             "# 3 network-namespace hosts on one 2-core machine; SmolLM2 on vLLM (CPU); UCX over TCP on the hosts' links",
             ]
    if "A_start_s" in o:  # deployment A ran (--deployments)
        lines.append(f"A (1 prefill on host 1 + 1 decode on host 2): up in {o.get('A_start_s')} s")
    for r in o.get("A_healthy", []):
        lines.append(f"  healthy {r['request']:<8} {r['outcome']:<10} {r['seconds']:>6} s  KV pulled "
                     f"{r['kv_bytes_pulled'] / 1e6:.1f} MB, decode link received {r['link_bytes_received'] / 1e6:.1f} MB")
    p = o.get("A_partition", {})
    for r in p.get("requests", []):
        lines.append(f"  partition {r['request']:<8} {r['outcome']:<10} right={r['right']} {r['seconds']:>6} s")
    if p:
        lines.append(f"  partition: breaker {p.get('breaker_during')}, /health {p.get('health_during')}, "
                     f"P/D again {p.get('pd_resumed_after_heal_s')} s after healing")
    for cap, rows in o.get("A_capped", {}).items():
        for r in rows:
            lines.append(f"  link {cap:<9} {r['request']:<8} {r['outcome']:<10} TTFT {r['ttft_s']} s, "
                         f"first->second {r['first_to_second_s']} s, total {r['seconds']} s, right={r['right']}")
    c = o.get("A_host_cut", {})
    if c:
        lines.append(f"  decode host cut {c.get('cut_s')} s: request during the cut {c.get('request_during_cut')}")
        lines.append(f"    Ray's nodes (address: alive) at the end of the cut {c.get('ray_nodes_during')}; 15 s after "
                     f"healing {c.get('ray_nodes_15s_after_heal')}; host 2's processes then "
                     f"{c.get('host2_processes_15s_after_heal')}")
        lines.append(f"    host 2's Ray node started again {c.get('node_restarted_after_heal_s')} s after healing "
                     f"(None: not needed); first good answer {c.get('first_good_answer_after_heal_s')} s after "
                     f"healing; Ray's nodes after {c.get('ray_nodes_after')}")
        lines.append(f"    engines after {c.get('engines_after')} (generations before {c.get('generations_before')}); "
                     f"vLLM engine cores per host after {c.get('engine_cores_per_host_after')}")
        for r in c.get("requests_after_heal", []):
            lines.append(f"    after healing: sent at {r.get('sent_after_heal_s')} s: {r['outcome']} in {r['seconds']} s "
                         f"right={r['right']}")
        for snap in c.get("ray_timeline_after_heal", []):
            lines.append(f"    Ray at {snap['t']} s after healing: {({k: v for k, v in snap.items() if k != 't'})}")
        for e in c.get("control_events", []):
            lines.append(f"    {e['source']} at {e['t']} s from healing: {e.get('engine')} {e.get('step')} {e.get('detail', '')}")
    if "B_start_s" in o:  # deployment B ran (--deployments)
        lines.append(f"B (2 both engines, SLO placement): up in {o.get('B_start_s')} s; host 2's link at 50 Mbit/s")
        lines += slow_link_lines(o.get("B_slow_link", {}))
        lost = o.get("B_host_lost", {})
        for r in lost.get("in_flight", []) + lost.get("after", []):
            lines.append(f"  host 2 lost: {r['request']:<12} {r['outcome']:<10} {r['seconds']} s")
        if lost:
            lines.append(f"  host 2 lost: last in-flight outcome {lost.get('loss_to_last_in_flight_outcome_s')} s after "
                         f"the loss; /health after: {(lost.get('health_after') or {}).get('code')}")
    if "C_start_s" in o:
        lines.append(f"C (B with router.placement colocate): up in {o.get('C_start_s')} s; host 2's link at 50 Mbit/s")
        lines += slow_link_lines(o.get("C_slow_link", {}))
    b, c = (o.get(k, {}).get("rounds") for k in ("B_slow_link", "C_slow_link"))
    first = _first_learned_round(o.get("B_slow_link", {}))
    if b and c and first is not None:
        learned = {"requests": [r for rnd in b[first:] for r in rnd["requests"]]}
        base = {"requests": [r for rnd in c for r in rnd["requests"]]}
        lines.append(f"B's rounds {first + 1}-{len(b)} ({len(learned['requests'])} requests: those that began with "
                     f"every pair's pull learned, {len(o['B_slow_link']['pairs'])} pairs) against C's {len(c)} rounds "
                     f"({len(base['requests'])} requests):")
        for m, name in (("first_to_second_s", "first->second"), ("seconds", "total")):
            lines.append(f"  {name}: mean {_mean(learned, m)} vs {_mean(base, m)} s = "
                         f"{_mean(learned, m) / _mean(base, m):.2f}x, p50 {_p50(learned, m)} vs {_p50(base, m)} s = "
                         f"{_p50(learned, m) / _p50(base, m):.2f}x colocated")
    if o.get("aborted"):
        lines.append(f"ABORTED: {o['aborted']}")
    lines.append(f"teardown leftovers: {o.get('teardown_leftovers')}")
    return "\n".join(lines) + "\n"


def slow_link_lines(link: dict) -> list[str]:
    lines = []
    for i, rnd in enumerate(link.get("rounds", [])):
        done = [r for r in rnd["requests"] if r["outcome"] == "completed"]
        lines.append(f"  round {i + 1}: {len(done)}/{len(rnd['requests'])} completed; mean TTFT {_mean(rnd, 'ttft_s')} s, "
                     f"first->second {_mean(rnd, 'first_to_second_s')} s (max {_max(rnd, 'first_to_second_s')} s), "
                     f"total {_mean(rnd, 'seconds')} s; decisions {rnd['decisions']}; pulls {rnd.get('pulls')}; "
                     f"learned pull rates "
                     f"{rnd['learned_pull_rates']}")
    return lines


def _mean(rnd: dict, key: str) -> float:
    vals = [r[key] for r in rnd["requests"] if r.get(key) is not None]
    return round(sum(vals) / len(vals), 3) if vals else float("nan")


def _first_learned_round(link: dict) -> int | None:
    """The index of B's first round that began with a learned pull (rate or failure price) for every
    pair placement may pull over: what "once the pair's rate is learned" compares."""
    pairs = set(link.get("pairs", ()))
    for i, rnd in enumerate(link.get("rounds", [])[:-1]):
        if pairs and pairs <= set(rnd.get("learned_pull_rates") or {}):
            return i + 1
    return None


def _p50(rnd: dict, key: str) -> float:
    vals = sorted(r[key] for r in rnd["requests"] if r.get(key) is not None)
    return round(vals[len(vals) // 2], 3) if vals else float("nan")


def _max(rnd: dict, key: str) -> float | None:
    return max((r[key] for r in rnd["requests"] if r.get(key) is not None), default=None)


if __name__ == "__main__":
    raise SystemExit(main())
