"""How `raypd status`, `down` and `profile` reach the running service: its state file or `--address`."""

from __future__ import annotations

import argparse
import sys

from serving.cli import runstate

NOT_RUNNING = "no running raypd found (start one with `raypd up`, or pass --address)"


def connect(args: argparse.Namespace, state: runstate.UpState | None) -> bool:
    import ray

    from serving.cluster.ray_init import init_ray, use_ray_token_auth

    address = args.address or (state.gcs_address if state else None)
    if not address:
        return False
    if state is not None and not args.address and state.ray_auth_mode == "token":
        use_ray_token_auth()  # our own record says so (an explicit address never turns token mode on by itself)
    init_ray(None, address=address)
    return ray.is_initialized()


def attach(args: argparse.Namespace, state: runstate.UpState | None, command: str, missing: str = NOT_RUNNING) -> bool:
    """Connects to the running raypd; False after printing why not (`missing`: when none runs)."""
    from serving.cluster.ray_init import RayAuthError

    try:
        if connect(args, state):
            return True
    except RayAuthError as exc:
        print(f"raypd {command}: {exc}", file=sys.stderr)
        return False
    print(f"raypd {command}: {missing}", file=sys.stderr)
    return False
