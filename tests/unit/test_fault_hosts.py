"""benchmarks/faults.py's partition phase, its pure parts: the across-hosts raypd config, the injector's
timing, which references a phase is judged by, and the table's partition row."""

from __future__ import annotations

import time

import yaml

from benchmarks import faults as faults_bench
from pdbench import fault_report, fault_results
from pdbench.fault_inject import Injector, settled
from pdbench.hosts_groups import across_hosts_config

ROOT = faults_bench.ROOT


def test_the_across_hosts_config_pins_each_role_to_its_hosts_resource_and_opens_the_front(tmp_path):
    b = yaml.safe_load(across_hosts_config(ROOT / "benchmarks/configs/pd_1p1d.yaml", tmp_path / "b.yaml").read_text())
    e = yaml.safe_load(across_hosts_config(ROOT / "benchmarks/configs/pd_default.yaml", tmp_path / "e.yaml").read_text())
    assert (b["prefill"]["resources"], b["decode"]["resources"], e["both"]["resources"]) == (
        {"prefill": 1}, {"decode": 1}, {"engine": 1})
    assert (b["http"]["host"], b["ray"], b["decode"]["cpu"], b["router"]) == (
        "0.0.0.0", {"address": "auto"}, {"bind": ["1"]}, {"placement": "disaggregate",
                                                          "no_prefill_fallback": "decode_local"})


def test_the_across_hosts_config_is_a_valid_raypd_config(tmp_path):
    from serving.config import load_config

    cfg = load_config(str(across_hosts_config(ROOT / "benchmarks/configs/pd_default.yaml", tmp_path / "e.yaml")))
    assert cfg.router.placement == "slo"


def test_the_injector_begins_at_its_time_and_ends_after_the_hold():
    calls: list[tuple[str, float]] = []
    t0 = time.monotonic()
    inj = Injector(lambda: calls.append(("cut", time.monotonic() - t0)) or [1, 2],
                   lambda: calls.append(("heal", time.monotonic() - t0)), t0, 0.05, 0.1)
    inj.start()
    inj.join(5)
    assert [c for c, _ in calls] == ["cut", "heal"]
    assert inj.hit == [1, 2] and calls[1][1] - calls[0][1] >= 0.1 and inj.until_s > inj.fault_s >= 0.05


def test_the_partition_phase_is_judged_by_the_across_hosts_references():
    res = {"references": {"b": ["one-host"]}, "phase_references": {"b": {faults_bench.PARTITION: ["hosts"]}}}
    assert fault_results.references_of(res, "b", faults_bench.PARTITION) == ["hosts"]
    assert fault_results.references_of(res, "b", "decode SIGKILL") == ["one-host"]


def test_held_leases_or_blocks_are_not_at_rest():
    rest = {"leases_held": 0.0, "engine_running_requests": 0.0, "engine_free_blocks": 364.0,
            "engine_num_blocks": 364.0}
    assert settled(rest)
    assert not settled({**rest, "leases_held": 4.0})
    assert not settled({**rest, "engine_free_blocks": 356.0})
    assert not settled({"n/a": "the set-up exposes no lease or block counts"})


def test_the_table_names_the_cut_and_drops_the_not_measured_partition_line():
    info = {"partition_s": 20.0, "hosts_startup_s": 52.1, "references": "12/12 in 30 s",
            "decode_host_rx_mb": 80.2, "at_rest": {"leases_held": 0.0}, "at_rest_after_s": 14.0}
    line = fault_report.info_line(info)
    assert line.startswith("hosts 1 and 2 cut from each other for 20.0 s")
    assert "nothing held 14.0 s after recovery" in line
    res = {"figures": {"b": {faults_bench.PARTITION: {
        "sent": 1, "counts": {"right": 1, "wrong": 0, "tie": 0, "cut": 0, "hung": 0, "error": 0},
        "wrong_rate": 0.0, "goodput_before": 0.1, "goodput_during": 0.1, "goodput_after": 0.1,
        "first_good_s": 3.0, "details": {}}}}, "phase_info": {"b": {faults_bench.PARTITION: info}}}
    table = fault_report.table(res)
    assert "P<->D partition (hosts)" in table and fault_report.NO_PARTITION not in table
