"""Where a results file comes from: the commit it was measured on (its header names it)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any


def git_state(root: Path) -> dict[str, Any]:
    """HEAD's commit and branch, and how many files outside benchmarks/results/ differ from it."""
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    dirty = [line for line in git("status", "--porcelain").splitlines() if "benchmarks/results/" not in line]
    return {"commit": git("rev-parse", "HEAD"), "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
            "dirty_files": len(dirty)}


def header_line(state: dict[str, Any]) -> str:
    return (f"# git: {state.get('commit', '?')[:12]} ({state.get('branch')}, "
            f"{state.get('dirty_files')} uncommitted files outside results/)")
