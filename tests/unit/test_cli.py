import json
from pathlib import Path

import pytest
import yaml

from serving.cli import quickstart
from serving.bench.load import plot
from serving.bench.samples import LevelResult, Sample, percentile, summarize
from serving.cli.main import COMMANDS, DEFAULT_CONFIG, _load, build_parser, main
from serving.config import load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def private_run_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))


def test_help_lists_every_command(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_up_accepts_config_address_and_port():
    args = build_parser().parse_args(["up", "--config", "x.yaml", "--address", "auto", "--port", "8123"])
    assert (args.command, args.config, args.address, args.port) == ("up", "x.yaml", "auto", 8123)


def test_status_and_down_parse():
    args = build_parser().parse_args(["status", "--json", "--temp-dir", "/tmp/x"])
    assert args.json and args.temp_dir == "/tmp/x"
    assert build_parser().parse_args(["down"]).command == "down"


def test_status_without_a_running_service_says_so(tmp_path, capsys):
    assert main(["status", "--temp-dir", str(tmp_path)]) == 1
    assert "no running raypd" in capsys.readouterr().err


def test_bench_arguments():
    args = build_parser().parse_args(["bench", "--url", "http://h:1", "--concurrency", "1,4", "--prompt-len", "8",
                                      "--output-len", "4", "--requests", "3", "--plot", "p.png"])
    assert (args.url, args.concurrency, args.prompt_len, args.output_len, args.requests, args.plot) == (
        "http://h:1", "1,4", 8, 4, 3, "p.png")
    assert not args.overhead


def test_bench_statistics_and_plot(tmp_path):
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 99) == 5
    samples = [Sample(ok=True, ttft=0.1, e2e=0.5, itls=[0.01, 0.03], output_tokens=3),
               Sample(ok=True, ttft=2.0, e2e=3.0, itls=[0.02], output_tokens=2),
               Sample(ok=False, error="HTTP 503")]
    r = summarize(4, samples, wall_s=2.0, slo_ttft_s=1.0, slo_itl_s=0.05)
    assert (r.requests, r.errors, r.req_per_s, r.goodput_req_per_s, r.output_tok_per_s) == (3, 1, 1.0, 0.5, 2.5)
    assert r.first_error == "HTTP 503" and r.ttft_ms["p50"] == 1050.0
    json.dumps(r.__dict__)
    out = tmp_path / "p.png"
    plot([r, LevelResult(**{**r.__dict__, "concurrency": 8})], str(out), "t")
    assert out.read_bytes()[:4] == b"\x89PNG"


# ------------------------------------------------------------------ one-line start
def tiny_folder(tmp_path) -> Path:
    folder = tmp_path / "My-Model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    return folder


def test_up_without_flags_is_the_embedded_default():
    assert Path(DEFAULT_CONFIG) == ROOT / "configs" / "local.yaml"
    assert _load(build_parser().parse_args(["up"])) == load_config(ROOT / "configs" / "local.yaml")


def test_config_prints_yaml_that_up_config_reads_back(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(quickstart.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    folder = tiny_folder(tmp_path)
    monkeypatch.chdir(tmp_path)
    argv = ["--model", "My-Model", "--prefill", "2", "--decode", "1", "--decode-tp", "2",
            "--engine-arg", "max_num_seqs=8", "--engine-arg", "enable-prefix-caching=false",
            "--decode-engine-arg", "max_model_len=1024"]
    assert main(["config", *argv]) == 0
    text = capsys.readouterr().out
    path = tmp_path / "d.yaml"
    path.write_text(text)
    cfg = load_config(path)
    assert cfg == _load(build_parser().parse_args(["up", *argv]))  # what `up` would run, and `up --config` reads
    assert cfg.model == str(folder) and cfg.served_model_name == "My-Model"
    assert (cfg.prefill.count, cfg.decode.count, cfg.prefill.tp_size, cfg.decode.tp_size) == (2, 1, 1, 2)
    assert cfg.engine_kwargs == {"max_num_seqs": 8, "enable_prefix_caching": False}
    assert cfg.max_model_len == 1024  # an engine argument raypd owns lands in its field
    if quickstart.cpu_only_vllm():  # one range of cores per rank on a CPU build
        assert (cfg.prefill.cpu.bind, cfg.decode.cpu.bind) == (["0", "1"], ["2|3"])
    assert yaml.safe_load(text)["model"] == str(folder)


def test_flags_override_a_config_file():
    args = build_parser().parse_args(["up", "--config", str(ROOT / "configs" / "local.yaml"),
                                      "--engine-arg", "max_num_seqs=4", "--port", "8123"])
    cfg = _load(args)
    base = load_config(ROOT / "configs" / "local.yaml")
    assert cfg.engine_kwargs == {**base.engine_kwargs, "max_num_seqs": 4} and cfg.http.port == 8123
    assert cfg.prefill.cpu.bind == base.prefill.cpu.bind


@pytest.mark.parametrize("ranks, cores, binds", [
    ([1, 1], [0, 1], ["0", "1"]),
    ([2, 2], [0, 1], ["0|1", "0|1"]),
    ([1, 1], list(range(16)), ["0-7", "8-15"]),
    ([2, 1], [0, 1, 2, 3, 4, 5], ["0-1|2-3", "4-5"]),
])
def test_cpu_binds(ranks, cores, binds):
    assert quickstart.cpu_binds(ranks, cores) == binds


def test_engine_arg_needs_key_and_value(capsys):
    assert main(["config", "--engine-arg", "max_num_seqs"]) == 2
    assert "expected KEY=VALUE" in capsys.readouterr().err


def test_an_unknown_engine_argument_is_refused_naming_it(capsys):
    assert main(["config", "--engine-arg", "max_num_seqz=4"]) == 2
    assert "engine_kwargs.max_num_seqz: not a vLLM engine argument" in capsys.readouterr().err


def test_up_with_a_hub_id_and_no_hub_access_fails_before_ray_naming_the_ways_out(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    assert main(["up", "--model", "nobody/no-such-model", "--temp-dir", str(tmp_path / "ray")]) == 1
    err = capsys.readouterr().err
    assert "HF_HUB_OFFLINE" in err and "local model folder" in err
    assert not (tmp_path / "ray").exists()  # failed before any Ray process started


def test_inline_api_keys_are_refused_with_the_alternatives(tmp_path, capsys):
    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump({"http": {"api_keys": ["sk-1"]}}))
    assert main(["up", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "RAYPD_API_KEYS" in err and "http.api_keys_file" in err and "sk-1" not in err


def test_a_refused_ray_token_is_recognised_through_ray_inits_wrapping():
    from serving.cluster.ray_init import _refused_token

    def wrapped(inner: Exception) -> ConnectionError:  # how ray.init 2.60 reports it
        try:
            try:
                raise inner
            except RuntimeError as exc:
                raise ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379") from exc
        except ConnectionError as outer:
            return outer

    assert _refused_token(wrapped(RuntimeError("Failed to connect to GCS. Last connection error: ... "
                                               "AuthenticationError: RPC error: InvalidAuthToken: ...")))
    assert not _refused_token(wrapped(RuntimeError("Failed to connect to GCS: connection refused")))


def test_status_prints_the_ledgers_breakers(capsys):
    from serving.cli.status import print_status

    status = {"deployment": "d", "coordinator": "up", "engines": {}, "serve": None,
              "breakers": {"d-prefill-0->d-decode-0": {"state": "open", "failures": 3, "opened_count": 2,
                                                       "last_reason": "engine d-prefill-0 died: actor died"}}}
    print_status(status, None)
    out = capsys.readouterr().out
    assert "held by the coordinator's ledger" in out
    assert "d-prefill-0->d-decode-0" in out and "open" in out and "failures=3" in out and "opened=2" in out
    assert "last: engine d-prefill-0 died: actor died" in out


def test_status_prints_the_launchers_node_loss_steps(capsys):
    from serving.cli.status import print_status

    status = {"deployment": "d", "coordinator": "up", "engines": {}, "serve": None, "breakers": {},
              "node_loss": [{"t": 0.0, "engine": "d-decode-0", "step": "replaced", "detail": ""},
                            {"t": 60.0, "engine": "d-decode-0", "step": "start_failed",
                             "detail": "Unschedulable: no node offers it"}]}
    print_status(status, None)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("node loss")]
    assert [ln.split()[3:] for ln in lines] == [["d-decode-0", "replaced"],
                                                ["d-decode-0", "start_failed:", "Unschedulable:", "no", "node",
                                                 "offers", "it"]]


def test_the_launch_line_counts_every_role_that_has_engines():
    from serving.cli.main import engine_counts
    from serving.config import load_config

    assert (engine_counts(load_config("configs/local.yaml")), engine_counts(load_config("configs/local-pd.yaml"))) == (
        "2 both", "1 prefill + 1 decode")
