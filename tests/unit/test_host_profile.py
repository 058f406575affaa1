"""Which profile `raypd config --plan` plans from (serving/sizing/host_profile.py, serving/cli/plan.py):
--profile, else this host's own, else a measurement of this host on first use, else the shipped one,
and the plan names the source it used."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from serving.cli import plan as plan_cli
from serving.cli.host_measure import sizes_to_measure
from serving.cli.main import main
from serving.config import DeploymentConfig
from serving.sizing.host_profile import (SHIPPED_PROFILE, HostKey, choose_profile, cpu_model, host_profile_path,
                                         profile_dir)
from serving.sizing.profile import ProfileError

ROOT = Path(__file__).resolve().parents[2]
KEY = HostKey(cpu_model="AMD EPYC 9B14 96-Core Processor", cores=2, model="smollm2")
HOST = {"unit": "cpu", "total_units": 2, "transfer_tokens_per_s": 20000, "transfer_overhead_s": 0.1,
        "engines": [{"cores": 1, "step_s": 0.049, "step_per_stream_s": 0.002, "prefill_tokens_per_s": 500}]}


@pytest.fixture
def profiles(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("RAYPD_PROFILE_DIR", str(tmp_path / "profiles"))
    return tmp_path / "profiles"


def test_a_host_is_keyed_by_its_cpu_model_cores_and_model(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 9B14 96-Core Processor\n")
    assert cpu_model(str(info)) == KEY.cpu_model
    assert KEY.slug == "smollm2-amd-epyc-9b14-96-core-processor-2c"
    assert HostKey("/models/Qwen/Qwen3-8B", 2, "x").slug != HostKey("/models/Qwen/Qwen3-8B", 4, "x").slug


def test_the_profile_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("RAYPD_PROFILE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert profile_dir() == tmp_path / "cache" / "raypd" / "profiles"
    monkeypatch.setenv("RAYPD_PROFILE_DIR", str(tmp_path / "mine"))
    assert host_profile_path(KEY) == tmp_path / "mine" / f"{KEY.slug}.yaml"


def test_the_sources_in_order(profiles):
    assert choose_profile(None, KEY) is None  # nothing of this host yet: the caller measures, or falls back
    host = host_profile_path(KEY)
    host.parent.mkdir(parents=True)
    host.write_text(yaml.safe_dump(HOST))
    chosen = choose_profile(None, KEY)
    assert (chosen.source, chosen.profile.for_size(1).step_s) == ("host", 0.049)
    given = choose_profile(str(SHIPPED_PROFILE), KEY)
    assert (given.source, given.path) == ("file", SHIPPED_PROFILE)
    host.write_text("unit: tpu\n")
    with pytest.raises(ProfileError):
        choose_profile(None, KEY)


def test_a_cpu_box_measures_one_core_and_all_cores():
    assert sizes_to_measure(2) == (1, 2)
    assert sizes_to_measure(1) == (1,)


def _plan(tmp_path, capsys, *flags: str) -> tuple[int, str, str]:
    code = main(["config", "--plan", "--rates", "0.25", "--prompt-tokens", "256", *flags])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_without_a_host_profile_the_plan_measures_this_host_once(profiles, tmp_path, capsys, monkeypatch):
    calls = []

    def measure(base: DeploymentConfig, out: Path, seconds: float) -> None:
        calls.append((base.model, seconds))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(yaml.safe_dump(HOST))

    monkeypatch.setattr(plan_cli, "measure", measure)
    monkeypatch.setattr(plan_cli, "measurable", lambda cfg: None)
    code, out, err = _plan(tmp_path, capsys, "--measure-seconds", "30")
    assert (code, calls) == (0, [("smollm2", 30.0)])
    assert "measuring it once" in err and "profile: this host's measured profile" in err
    assert out.startswith("# planned by `raypd config --plan` from this host's measured profile")
    code, out, err = _plan(tmp_path, capsys)  # cached: not measured again
    assert (code, len(calls)) == (0, 1)
    assert "profile: this host's measured profile" in err


def test_with_no_measure_the_shipped_profile_is_labelled_another_machines(profiles, tmp_path, capsys):
    code, out, err = _plan(tmp_path, capsys, "--no-measure")
    assert code == 0
    assert "not measured (--no-measure)" in err
    assert out.startswith("# planned by `raypd config --plan` from the shipped profile of another machine")


def test_where_this_host_cannot_be_measured_the_plan_says_why(profiles, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(plan_cli, "measurable", lambda cfg: "a `raypd up` is running on this host")
    code, out, err = _plan(tmp_path, capsys)
    assert code == 0
    assert "not measured (a `raypd up` is running on this host)" in err
    assert "the shipped profile of another machine" in out.splitlines()[0]


def test_a_failed_measurement_is_an_error_not_a_silent_fallback(profiles, tmp_path, capsys, monkeypatch):
    from serving.cli.host_measure import MeasureError

    def measure(base, out, seconds):
        raise MeasureError("1x2 both did not become healthy")

    monkeypatch.setattr(plan_cli, "measure", measure)
    monkeypatch.setattr(plan_cli, "measurable", lambda cfg: None)
    code, out, err = _plan(tmp_path, capsys)
    assert (code, out) == (2, "")
    assert "did not become healthy" in err


def test_a_bad_flag_is_refused_before_any_measurement(profiles, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(plan_cli, "measure", lambda *a: pytest.fail("measured despite a bad flag"))
    monkeypatch.setattr(plan_cli, "measurable", lambda cfg: None)
    code, out, err = _plan(tmp_path, capsys, "--rates", "x")
    assert (code, out) == (2, "")
    assert "--rates 'x'" in err
