"""The fault suites share the integration tests' service helpers (free port, in-thread uvicorn)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "integration"))
