import json

from serving.bench import LevelResult, Sample, percentile, plot, summarize
from serving.cli import COMMANDS, build_parser, main


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
