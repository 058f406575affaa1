"""The token inbox on and off, side by side on `raypd up`'s default (issue 30 item 2: the hop decided by
measurement). Each phase starts the default with RAYPD_TOKEN_INBOX=1 or 0, warms it with 4 requests, then
sends 40 Poisson requests at 0.5 req/s (512-token prompts, 64-token answers; the same schedule for both),
and prints TTFT p50/p90, TPOT p50 and the CPU per streamed token of the serving processes (/proc).
Phases alternate: 1 0 0 1 (--pairs 2). Usage: python benchmarks/token_inbox_ab.py [--pairs 2] [--out FILE]
"""
import argparse, asyncio, os, subprocess, sys, time, json, statistics
from pathlib import Path
import httpx, psutil
ROOT = Path(__file__).resolve().parents[1]; sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from serving.bench.provenance import git_state, header_line
from pdbench import client
RAYPD = [sys.executable, "-m", "serving.cli"]
def cpu_by_name():
    out = {}
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = " ".join(p.info["cmdline"] or [])
            key = next((k for k in ("EngineActor", "RaypdIngress", "ProxyActor", "VLLM::EngineCore", "VLLM::Worker", "Coordinator") if k in cmd or k in p.name()), None)
            if key is None: continue
            t = p.cpu_times(); out[key] = out.get(key, 0) + t.user + t.system
        except psutil.Error: pass
    return out
def one(inbox: str, port: int):
    temp = f"/tmp/raypd-ab-{inbox}"
    env = dict(os.environ, RAYPD_TOKEN_INBOX=inbox)
    up = subprocess.Popen([*RAYPD, "up", "--port", str(port), "--temp-dir", temp], cwd=ROOT, env=env, stdout=open(f"/tmp/ab-up-{inbox}.log", "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        t = time.monotonic()
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200: break
            except httpx.HTTPError: pass
            assert up.poll() is None and time.monotonic() - t < 420
            time.sleep(1)
        asyncio.run(client.poisson(url, "smollm2", client.poisson_requests(1, 0, 1.0, 4, {512: 1.0}, 16, 49152), 120.0, 30.0))
        c0 = cpu_by_name()
        reqs = client.poisson_requests(0, 0, 0.5, 40, {512: 1.0}, 64, 49152)
        records, dur = asyncio.run(client.poisson(url, "smollm2", reqs, 300.0, 90.0))
        c1 = cpu_by_name()
        ok = [r for r in records if r.ok]
        toks = sum((r.completion_tokens or len(r.token_times_s)) for r in ok)
        ttft = sorted(r.ttft_s for r in ok)
        tpot = sorted((r.token_times_s[-1] - r.ttft_s) / ((r.completion_tokens or len(r.token_times_s)) - 1) for r in ok if len(r.token_times_s) > 1)
        cpu = {k: round((c1.get(k, 0) - c0.get(k, 0)) / toks * 1e3, 2) for k in c1}
        return (f"inbox={inbox} ok {len(ok)}/{len(records)} tokens {toks} TTFT p50 {statistics.median(ttft):.2f} p90 {ttft[int(.9*len(ttft))]:.2f} TPOT p50 {statistics.median(tpot)*1e3:.1f} ms; CPU ms/token {cpu}")
    finally:
        subprocess.run([*RAYPD, "down", "--temp-dir", temp], cwd=ROOT, capture_output=True, timeout=180)
        up.wait(60)
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    lines = [f"# {time.strftime('%Y-%m-%dT%H:%M:%S%z')}; command: {' '.join(sys.argv)}", header_line(git_state(ROOT)),
             f"# host: {os.cpu_count()} CPUs, load average before {[round(x, 2) for x in os.getloadavg()]}"]
    order = [x for p in range(args.pairs) for x in (("1", "0") if p % 2 == 0 else ("0", "1"))]
    lines.append(f"raypd up default (configs/local.yaml), 40 Poisson requests at 0.5 req/s per phase, order {' '.join(order)}")
    for inbox in order:
        lines.append(one(inbox, 8020 + int(inbox)))
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
