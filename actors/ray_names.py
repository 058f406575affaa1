"""Where every raypd process finds the coordinator: its actor name and Ray namespace.

A module of its own so that engines, the CLI and the launcher can look the coordinator up
without importing the coordinator's module (and with it the control plane's state).
"""

from __future__ import annotations

COORDINATOR_NAME = "raypd-coordinator"
NAMESPACE = "raypd"  # every named raypd actor lives here
ENGINE_ACTOR_PREFIX = "raypd-"  # a launched engine's actor is named this + its engine id
