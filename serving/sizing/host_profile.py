"""Which hardware profile a plan uses, and where a host's own profile is kept.

  HostKey.of(model)       this host as a profile is keyed: CPU model, cores this process may use, model
  profile_dir()           $RAYPD_PROFILE_DIR, else $XDG_CACHE_HOME/raypd/profiles, else ~/.cache/raypd/profiles
  host_profile_path(key)  the cached profile of one (CPU model, cores, model)
  ChosenProfile           the profile with its source ("file", "host", "shipped") and a one-line label
  choose_profile(...)     --profile if given, else this host's cached profile, else None (measure it,
                          or fall back to the shipped one, labelled as another machine's)

Invariant: a plan always says which source it used; the shipped profile is never presented as this
host's (it was measured on the development box of 2026-12-05: a one-core step of 29 ms, where
other 2-core boxes measured 49 ms).
"""

from __future__ import annotations

import os
import platform
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from serving.sizing.profile import HardwareProfile, load_profile

Source = Literal["file", "host", "shipped"]
SHIPPED_PROFILE = Path(__file__).resolve().parents[2] / "configs" / "profiles" / "smollm2-cpu.yaml"


@dataclass(frozen=True)
class HostKey:
    """What a profile's figures depend on that a plan can see: the CPU, how many cores, the model."""

    cpu_model: str
    cores: int
    model: str

    @classmethod
    def of(cls, model: str) -> "HostKey":
        return cls(cpu_model=cpu_model(), cores=len(os.sched_getaffinity(0)), model=model)

    @property
    def slug(self) -> str:
        """A file name: lower case, runs of other characters as one dash."""
        text = f"{self.model}--{self.cpu_model}--{self.cores}c"
        return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The first `model name` of /proc/cpuinfo (Linux), else what platform says, else "unknown-cpu"."""
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"


def profile_dir() -> Path:
    if os.environ.get("RAYPD_PROFILE_DIR"):
        return Path(os.environ["RAYPD_PROFILE_DIR"])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "raypd" / "profiles"


def host_profile_path(key: HostKey) -> Path:
    return profile_dir() / f"{key.slug}.yaml"


@dataclass(frozen=True)
class ChosenProfile:
    profile: HardwareProfile
    source: Source
    path: Path

    @property
    def label(self) -> str:
        if self.source == "file":
            return f"the profile given ({self.path})"
        if self.source == "host":
            return f"this host's measured profile ({self.path})"
        return (f"the shipped profile of another machine ({self.path}): a guess for this host; "
                "measure this host's with `raypd config --plan` without --no-measure, or `raypd profile`")


def choose_profile(explicit: str | None, key: HostKey) -> ChosenProfile | None:
    """--profile when given; else this host's cached profile; else None (the caller measures one,
    or takes `shipped()`). A cached file that does not validate raises ProfileError, like --profile's."""
    if explicit is not None:
        return ChosenProfile(load_profile(explicit), "file", Path(explicit))
    cached = host_profile_path(key)
    if cached.exists():
        return ChosenProfile(load_profile(cached), "host", cached)
    return None


def shipped() -> ChosenProfile:
    return ChosenProfile(load_profile(SHIPPED_PROFILE), "shipped", SHIPPED_PROFILE)
