#!/usr/bin/env bash
# The whole suite: unit (no Ray), integration (Ray, NIXL, vLLM), fault.
set -euo pipefail
cd "$(dirname "$0")/.."
export RAY_USAGE_STATS_ENABLED=0 RAY_AUTH_MODE=disabled
exec .venv/bin/python -m pytest tests -q --timeout=900 "$@"
