"""Session-wide settings: Ray without auth or usage stats, temp dirs under /tmp."""

import os

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
