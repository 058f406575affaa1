from serving.cli import COMMANDS, build_parser, main


def test_help_lists_every_command(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    for name in COMMANDS:
        assert name in out


def test_up_accepts_config_and_address():
    args = build_parser().parse_args(["up", "--config", "x.yaml", "--address", "auto"])
    assert (args.command, args.config, args.address) == ("up", "x.yaml", "auto")
