"""The serving set-ups under test, each a group of processes this benchmark starts and stops.

  PlainVllm   (a)  vLLM's OpenAI server on core 0, queried directly;
              (a2) the same server plus a second one on core 1 behind a least-loaded balancer
  WideVllm    (a') one vLLM OpenAI server computing on both cores (VLLM_CPU_OMP_THREADS_BIND 0-1): the
                   CPU twin of one TP-2 engine, the colocated baseline of DistServe-style comparisons
  RaypdUp     (b)  `raypd up` with one prefill (core 0) and one decode (core 1) engine, its real front;
              (e)  `raypd up` as shipped: two role-flexible engines (cores 0, 1), SLO-aware placement
              (e0) (e) with placement that never disaggregates (pdbench/colocated.py)
              (ep) the shape `raypd config --plan` picks for the benchmark's load (pdbench/planned.py)
  VllmNixlPD  (c)  two vLLM OpenAI servers with NixlConnector (prefill core 0, decode core 1) and a proxy
                   doing what vLLM's documented disaggregated proxy does
  ServeLLM    (d)  Ray Serve LLM's `build_pd_openai_app` (NixlConnector), as shipped;
              (dc) its colocated twin `build_openai_app` (one engine, core 0)

Life cycle of a group: `start()` launches its processes (each in its own session,
logs under the run directory) and waits until every endpoint answers
/v1/models; `pin()` confines each vLLM worker to its engine's core (see
procs.pin_engine_workers); `idle_pids()` lists the processes whose CPU the idle
table reports; `stop()` asks politely (SIGTERM), then kills whatever of the
group's process tree is still alive, and returns the pids that survived even that.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from pdbench import colocated, faults, planned, procs

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


class SetupError(RuntimeError):
    pass


def free_port() -> int:
    """A port nothing listens on, below the kernel's ephemeral range: a port the kernel handed out
    (bind to 0) may be handed out again to one of Ray's own sockets before the server binds it
    (seen: Serve's proxy failed to bind its HTTP port)."""
    import random
    import socket

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for port in random.Random().sample(range(20000, max(20001, low)), 200):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise SetupError("no free port below the ephemeral range")


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = f"{ROOT}:{HERE.parent}" + (f":{env['PYTHONPATH']}" if env.get("PYTHONPATH") else "")
    env.update({"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"})
    return env


class Group:
    key = "?"

    def __init__(self, settings: dict, model_path: str, run_dir: Path):
        self.s, self.model_path, self.run_dir = settings, model_path, run_dir
        self.procs: list[subprocess.Popen] = []
        self.endpoints: dict[str, str] = {}  # set-up key -> base URL (without /v1)
        self.pinned: list[dict] = []
        self.log_paths: list[Path] = []
        self._logged_binds: dict[int, str] = {}

    # ---------------------------------------------------------------- helpers
    def spawn(self, name: str, cmd: list[str], env: dict | None = None, stdin: bool = False) -> subprocess.Popen:
        log = self.run_dir / f"{self.key}-{name}.log"
        self.log_paths.append(log)
        fh = open(log, "ab")
        proc = subprocess.Popen(cmd, env=env or base_env(), stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                start_new_session=True, cwd=ROOT)
        fh.close()
        self.procs.append(proc)
        return proc

    def wait_ready(self, urls: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        pending = list(urls)
        while pending:
            for p in self.procs:
                if p.poll() is not None:
                    raise SetupError(f"{self.key}: {p.args[:4]}... exited with {p.returncode} during start-up "
                                     f"(logs: {', '.join(map(str, self.log_paths))})")
            url = pending[0]
            try:
                if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                    pending.pop(0)
                    continue
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SetupError(f"{self.key}: {url} not ready after {timeout_s:.0f}s")
            time.sleep(0.5)

    def roots(self) -> list[int]:
        return [p.pid for p in self.procs]

    def all_pids(self) -> list[int]:
        return procs.tree(*self.roots())

    def log_files(self) -> list[Path]:
        files = list(self.log_paths)
        logs = self.session_logs()
        if logs is not None and logs.exists():
            files += [p for p in logs.iterdir() if p.suffix in (".out", ".err", ".log")]
        return files

    def session_logs(self) -> Path | None:
        return None

    def binds(self, pids: list[int]) -> dict[int, str]:
        """pid -> engine core bind; vLLM's log lines are read once per set of engine cores."""
        cores = {p for p in pids if procs.proc_name(p).startswith("VLLM::EngineCore")}
        if not cores <= set(self._logged_binds):
            self._logged_binds = procs.binds_from_logs(self.log_files())
        return procs.resolve_binds(pids, self._logged_binds)

    def pin(self) -> list[dict]:
        pids = self.all_pids()
        done = procs.pin_engine_workers(pids, self.binds(pids))
        self.pinned = [vars(d) for d in done]
        return self.pinned

    def idle_pids(self) -> list[int]:
        return self.all_pids()

    def stop(self, grace_s: float = 90.0) -> list[int]:
        seen = set(self.all_pids())
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace_s
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        seen |= set(self.all_pids())
        for pid in seen:
            if procs.alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        time.sleep(1.0)
        self.procs = []
        return sorted(pid for pid in seen if procs.alive(pid))

    def vllm_server(self, name: str, core: str, port: int, nixl_side_port: int | None = None) -> subprocess.Popen:
        s = self.s
        env = base_env()
        env.update({"VLLM_CPU_OMP_THREADS_BIND": core, "VLLM_CPU_KVCACHE_SPACE": str(s["kv_cache_gib"])})
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_path,
               "--served-model-name", s["served_model_name"], "--host", "127.0.0.1", "--port", str(port),
               "--dtype", s["dtype"], "--enforce-eager", "--max-model-len", str(s["max_model_len"]),
               "--block-size", str(s["block_size"]), "--max-num-seqs", str(s["max_num_seqs"]),
               "--max-num-batched-tokens", str(s["max_num_batched_tokens"]), "--seed", "0",
               "--enable-prefix-caching" if s["enable_prefix_caching"] else "--no-enable-prefix-caching",
               "--disable-uvicorn-access-log"]
        if nixl_side_port is not None:
            env.update({"VLLM_NIXL_SIDE_CHANNEL_PORT": str(nixl_side_port),
                        "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"})
            cmd += ["--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})]
        return self.spawn(name, cmd, env)

    def proxy(self, port: int, mode_args: list[str]) -> subprocess.Popen:
        return self.spawn("proxy", [sys.executable, str(HERE / "proxy.py"), "--port", str(port), *mode_args])


class PlainVllm(Group):
    key = "A"

    def start(self) -> None:
        p0, p1, pb = free_port(), free_port(), free_port()
        self.vllm_server("engine0", "0", p0)
        self.vllm_server("engine1", "1", p1)
        u0, u1 = f"http://127.0.0.1:{p0}", f"http://127.0.0.1:{p1}"
        self.wait_ready([u0, u1], self.s["start_timeout_s"])
        self.proxy(pb, ["balance", "--backend", u0, "--backend", u1])
        ub = f"http://127.0.0.1:{pb}"
        self.wait_ready([ub], 60)
        self.endpoints = {"a": u0, "a2": ub}


class WideVllm(Group):
    key = "AP"

    def start(self) -> None:
        port = free_port()
        self.vllm_server("engine", "0-1", port)  # vLLM binds its two OpenMP threads itself (one per core)
        url = f"http://127.0.0.1:{port}"
        self.wait_ready([url], self.s["start_timeout_s"])
        self.endpoints = {"ap": url}


class VllmNixlPD(Group):
    key = "C"

    def start(self) -> None:
        pp, pd, px = free_port(), free_port(), free_port()
        self.vllm_server("prefill", "0", pp, nixl_side_port=free_port())
        self.vllm_server("decode", "1", pd, nixl_side_port=free_port())
        up, ud = f"http://127.0.0.1:{pp}", f"http://127.0.0.1:{pd}"
        self.wait_ready([up, ud], self.s["start_timeout_s"])
        self.proxy(px, ["pd", "--prefill", up, "--decode", ud])
        ux = f"http://127.0.0.1:{px}"
        self.wait_ready([ux], 60)
        self.endpoints = {"c": ux}


RAYPD_TEMP = "/tmp/raypd-bench-ray"
SERVE_TEMP = "/tmp/raypd-bench-serve"


class RaypdUp(Group):
    """`raypd up --config <config>`: (b) with benchmarks/configs/pd_1p1d.yaml, (e) with pd_default.yaml,
    (e0) with pd_default.yaml made colocated-only, (ep) with the planner's shape from pd_default.yaml
    (both written to the run directory at start)."""

    CONFIGS = {"B": ("b", "raypd_config"), "E": ("e", "raypd_default_config"), "E0": ("e0", "raypd_default_config"),
               "EP": ("ep", "raypd_default_config")}

    def __init__(self, settings: dict, model_path: str, run_dir: Path, key: str = "B"):
        super().__init__(settings, model_path, run_dir)
        self.key = key
        self.setup, self.config_key = self.CONFIGS[key]
        self.idle_driver: subprocess.Popen | None = None
        self.bare_actor_pids: list[int] = []
        self.url = ""
        self.plan_table = ""  # (ep): what `raypd config --plan` printed

    def start(self) -> None:
        port = free_port()
        cfg = ROOT / self.s[self.config_key]
        if self.key == "E0":
            cfg = colocated.write_config(cfg, self.run_dir / "e0-config.yaml")
        elif self.key == "EP":
            load = self.s["load"]
            self.plan_table = planned.write_config(cfg, self.run_dir / "ep-config.yaml", load["rates"], load["mix"],
                                                   load["max_tokens"])
            cfg = self.run_dir / "ep-config.yaml"
        self.spawn("raypd-up", [sys.executable, "-c", "import sys; from serving.cli.main import main; sys.exit(main())",
                                "up", "--config", str(cfg), "--port", str(port), "--temp-dir", RAYPD_TEMP])
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + self.s["start_timeout_s"]
        while True:  # the front answers /health 200 once both engines are registered and paired
            if self.procs[0].poll() is not None:
                raise SetupError(f"raypd up exited with {self.procs[0].returncode} (log: {self.log_paths[0]})")
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SetupError(f"raypd up not healthy after {self.s['start_timeout_s']:.0f}s")
            time.sleep(0.5)
        self.wait_ready([url], 60)
        self.url = url
        self.endpoints = {self.setup: url}

    def decisions(self) -> dict[str, float]:
        """This front's placement decisions so far, `decision/reason` -> count
        (raypd_disagg_decisions_total of its /metrics; one ingress replica)."""
        from serving.bench.chat_compare import decisions_of

        try:
            return decisions_of(httpx.get(self.url + "/metrics", timeout=15).text)
        except httpx.HTTPError as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}

    def fault_counters(self) -> faults.Snapshot:
        """This front's fault counters now (pdbench/faults.py: deadline misses, migrations, hang kills)."""
        try:
            r = httpx.get(self.url + "/metrics", timeout=15)
            if r.status_code != 200:
                return faults.Snapshot(error=f"/metrics answered {r.status_code}")
            return faults.parse(r.text)
        except (httpx.HTTPError, ValueError) as exc:  # ValueError: not a Prometheus exposition
            return faults.Snapshot(error=f"{type(exc).__name__}: {exc}")

    def engine_settings(self) -> list[str]:
        """The vLLM settings each engine runs with, as `raypd up` read them back from its VllmConfig
        (serving/cli/status.py prints `<role> <engine id> ...` then `vllm: ...` per engine)."""
        out, engine = [], None
        text = self.log_paths[0].read_text(errors="replace") if self.log_paths else ""
        for line in text.splitlines():
            words = line.split()
            if len(words) > 1 and words[0] in ("prefill", "decode", "both") and line.startswith("  "):
                engine = f"{words[0]} {words[1]}"
            elif words[:1] == ["vllm:"] and engine:
                out.append(f"{engine}: {' '.join(words[1:])}")
                engine = None
        return out

    def start_idle_reference(self) -> list[int]:
        """Bare Ray actors in raypd's own cluster: the floor an idle actor process costs."""
        from serving.cli.runstate import read_state

        state = read_state(RAYPD_TEMP)  # `raypd up`'s record (a per-user folder)
        if state is None:
            raise SetupError(f"no `raypd up` record for {RAYPD_TEMP}")
        self.idle_driver = self.spawn("idle-actors", [sys.executable, str(HERE / "idle_actors.py"),
                                                      state.gcs_address], stdin=True)
        log = self.log_paths[-1]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            for line in log.read_text(errors="replace").splitlines():
                if line.startswith("PIDS "):
                    self.bare_actor_pids = [int(x) for x in line.split()[1:]]
                    return self.bare_actor_pids
            if self.idle_driver.poll() is not None:
                break
            time.sleep(0.3)
        raise SetupError(f"the bare idle actors did not start (log: {log})")

    def stop_idle_reference(self) -> None:
        if self.idle_driver is not None and self.idle_driver.poll() is None:
            self.idle_driver.stdin.close()
            try:
                self.idle_driver.wait(30)
            except subprocess.TimeoutExpired:
                self.idle_driver.kill()
        if self.idle_driver is not None:
            self.procs.remove(self.idle_driver)
            self.idle_driver = None
        self.bare_actor_pids = []

    def stop(self, grace_s: float = 90.0) -> list[int]:
        self.stop_idle_reference()
        return super().stop(grace_s)

    def session_logs(self) -> Path:
        return Path(RAYPD_TEMP) / "session_latest" / "logs"


class ServeLLM(Group):
    def __init__(self, settings: dict, model_path: str, run_dir: Path, mode: str):
        super().__init__(settings, model_path, run_dir)
        self.mode = mode
        self.key = "D" if mode == "pd" else "DC"

    def start(self) -> None:
        port = free_port()
        keys = ("dtype", "max_model_len", "block_size", "enable_prefix_caching", "max_num_seqs",
                "max_num_batched_tokens", "kv_cache_gib", "served_model_name")
        self.spawn("serve-llm", [sys.executable, str(HERE / "serve_llm_app.py"), "--mode", self.mode,
                                 "--model", self.model_path, "--port", str(port), "--temp-dir", SERVE_TEMP,
                                 "--settings", json.dumps({k: self.s[k] for k in keys})])
        url = f"http://127.0.0.1:{port}"
        self.wait_ready([url], self.s["start_timeout_s"])
        log = self.log_paths[-1]
        deadline = time.monotonic() + self.s["start_timeout_s"]
        while "READY" not in log.read_text(errors="replace"):
            if self.procs[0].poll() is not None or time.monotonic() > deadline:
                raise SetupError(f"Serve LLM ({self.mode}) did not deploy (log: {log})")
            time.sleep(0.5)
        self.endpoints = {"d" if self.mode == "pd" else "dc": url}

    def session_logs(self) -> Path:
        return Path(SERVE_TEMP) / "session_latest" / "logs"


def make_group(key: str, settings: dict, model_path: str, run_dir: Path) -> Group:
    if key == "A":
        return PlainVllm(settings, model_path, run_dir)
    if key in RaypdUp.CONFIGS:
        return RaypdUp(settings, model_path, run_dir, key)
    if key == "AP":
        return WideVllm(settings, model_path, run_dir)
    if key == "C":
        return VllmNixlPD(settings, model_path, run_dir)
    if key in ("D", "DC"):
        return ServeLLM(settings, model_path, run_dir, "pd" if key == "D" else "colocated")
    raise ValueError(f"unknown set-up group {key!r}")
