#!/usr/bin/env bash
# The whole suite: unit (no Ray), integration (Ray, NIXL, vLLM), fault; the 30 slowest tests at the end
# (the suite is kept under ~45 min on 2 cores: they show where the time goes).
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled
exec .venv/bin/python -m pytest tests -q --timeout=900 --durations=30 "$@"
