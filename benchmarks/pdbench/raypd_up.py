"""(b), (e), (e0), (ep): `raypd up` as a set-up group, its front's decisions and fault counters,
and the bare idle actors whose CPU the idle table compares against."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

from pdbench import colocated, faults, planned
from pdbench.group import HERE, ROOT, Group, SetupError, free_port

RAYPD_TEMP = "/tmp/raypd-bench-ray"


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
            return decisions_of(httpx.get(self.url + "/metrics", headers=self.headers, timeout=15).text)
        except httpx.HTTPError as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}

    def fault_counters(self) -> faults.Snapshot:
        """This front's fault counters now (pdbench/faults.py: deadline misses, migrations, hang kills)."""
        try:
            r = httpx.get(self.url + "/metrics", headers=self.headers, timeout=15)
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
