"""This host's profile, measured on first use by `raypd config --plan` (serving/sizing/host_profile.py).

1. The engine sizes a CPU box's plan considers: one core, and all the cores this process may use.
2. For each size, the base deployment reshaped to engines of that size filling the cores
   (serving/sizing/deployment.py) is started with `raypd up`, on a Ray temp dir and a port of its own.
3. `raypd profile --seconds S --out <this host's profile>` loads it through its front and writes that
   size's rates, the engines' own fits (its merge keeps the sizes already in the file).
4. `raypd down` stops it, whatever happened; the temp dir is removed.

Refused while a `raypd up` of this user runs on the default temp dir: its engines would compete for
the cores and both figures would be wrong. Measure that deployment instead (`raypd profile`: the live
engines' rates, written to this host's profile by default). A GPU deployment is not measured here:
its sizes are GPUs and its engines take minutes to start; `raypd profile` measures a running one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from serving.cli.scratch_up import RAYPD, ROOT, ScratchUpError, scratch_up
from serving.config import DeploymentConfig
from serving.sizing.deployment import deployment_yaml
from serving.sizing.shapes import Shape

START_TIMEOUT_S = 600.0  # two vLLM engines start in about a minute on 2 cores; a cold model cache takes longer


class MeasureError(RuntimeError):
    """The measurement could not run or did not finish; the message says which step and why."""


def sizes_to_measure(cores: int) -> tuple[int, ...]:
    return tuple(sorted({1, cores}))


def measurable(cfg: DeploymentConfig) -> str | None:
    """Why this deployment cannot be measured here (None: it can)."""
    from serving.cli import runstate
    from serving.cluster.ray_init import DEFAULT_TEMP_DIR

    if any(getattr(cfg, role).resources.get("GPU") for role in ("prefill", "decode", "both")):
        return "a GPU deployment: start it and run `raypd profile` against it"
    if cfg.backend != "vllm":
        return f"backend {cfg.backend!r}: only vLLM engines have rates worth planning with"
    if runstate.read_state(DEFAULT_TEMP_DIR) is not None:
        return ("a `raypd up` is running on this host: its engines would compete with the measurement; "
                "run `raypd profile` against it (it writes this host's profile)")
    return None


def measure(base: DeploymentConfig, out: Path, seconds: float, log=sys.stderr) -> None:
    """Every size of `sizes_to_measure`, one `raypd up` at a time, into `out`; MeasureError on failure
    (`out` then holds the sizes measured before it, or nothing)."""
    cores = len(os.sched_getaffinity(0))
    base_data = base.model_dump(mode="json", exclude_defaults=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    for size in sizes_to_measure(cores):
        shape = Shape(colocated=(size,) * (cores // size))
        print(f"raypd: measuring {shape.label} ({size}-core engines): start, {seconds:.0f} s of load, stop",
              file=log, flush=True)
        try:
            with scratch_up(deployment_yaml(shape, base_data, "cpu"), START_TIMEOUT_S) as up:
                done = subprocess.run([*RAYPD, "profile", "--temp-dir", up.temp_dir, "--out", str(out),
                                       "--seconds", str(seconds)], cwd=ROOT, capture_output=True, text=True,
                                      timeout=seconds + 600)
        except ScratchUpError as exc:
            raise MeasureError(f"{shape.label}: {exc}") from None
        if done.returncode != 0:
            raise MeasureError(f"raypd profile of {shape.label} failed ({done.returncode}): "
                               f"{(done.stdout + done.stderr)[-1500:]}")
        print(done.stdout.strip().splitlines()[-2], file=log, flush=True)  # the size's fitted rates
