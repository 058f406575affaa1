"""`raypd` command line: `up`, `status`, `down`, `bench`."""

from __future__ import annotations

import argparse
import sys

COMMANDS = {
    "up": "start (or join) a Ray cluster, the coordinator and the engines, and serve the OpenAI API",
    "status": "show engines, roles, health, load, breaker states and in-flight transfers",
    "down": "stop the engines and the coordinator started by `raypd up`",
    "bench": "run a benchmark (transfer, pd, serve)",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="raypd", description="Ray-native disaggregated prefill/decode LLM serving."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, help_text in COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        if name in ("up", "status", "down"):
            cmd.add_argument("--config", default="configs/local.yaml", help="deployment YAML")
            cmd.add_argument("--address", default=None, help="join an existing Ray cluster")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    print(f"raypd {args.command}: not yet implemented", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
