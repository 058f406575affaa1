"""How raypd creates a NIXL agent: from the binding, with UCX's progress thread asleep on an fd.

A progress thread because, in UCX's ``peer`` error mode, a READ only completes when the *target*
agent drives UCX progress too, and a producer's one Python thread is busy computing prefill steps
(docs/nixl_notes.md). Not `nixl._api.nixl_agent`: it hard-codes ``pthrDelay = 0``, a thread
waking every millisecond; raypd builds the agent from the binding with a 1 s ``poll()`` timeout, so
the thread sleeps until UCX has an event and no thread here spins.

Threads: with the progress thread on, the UCX worker is multi-threaded and incoming notifications
are collected under the thread's own mutex; the agent's own state gets ``NIXL_THREAD_SYNC_STRICT``
(every API call holds the agent's lock), which the progress thread never takes, so it never waits
behind the owner.
"""

from __future__ import annotations

from typing import Any

from actors.kv.transfer_errors import TransferSetupError
from actors.kv.nixl.nixl_checks import err

PROGRESS_WAKEUP_US = 1_000_000
"""Timeout of the progress thread's ``poll()`` on the UCX event fd (a safety net only)."""


def load_nixl_api() -> Any:
    """Import `nixl._api` on first use (it probes CUDA and loads plugins)."""
    try:
        import nixl  # noqa: F401  (selects nixl_cu12 / nixl_cu13 / nixl_rocm)
        from nixl import _api
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise TransferSetupError(f"nixl is not importable: {exc}") from exc
    return _api


def new_agent(name: str, backend: str) -> Any:
    """A `nixlBind.nixlAgent` with `backend` created, its progress thread asleep on UCX's fd.

    The backend is created explicitly: NIXL only logs a warning when a
    requested plugin is missing.
    """
    bind = load_nixl_api().nixlBind
    config = bind.nixlAgentConfig()
    config.useProgThread = True
    config.pthrDelay = PROGRESS_WAKEUP_US
    config.useListenThread = False  # metadata travels over Ray, not NIXL's own socket
    config.syncMode = bind.NIXL_THREAD_SYNC_STRICT
    config.captureTelemetry = False
    try:
        agent = bind.nixlAgent(name, config)
    except Exception as exc:
        raise TransferSetupError(f"cannot create NIXL agent {name!r}: {err(exc)}") from exc
    plugins = list(agent.getAvailPlugins())
    if backend not in plugins:
        raise TransferSetupError(f"NIXL backend plugin {backend!r} not available (have {sorted(plugins)})")
    try:
        agent.createBackend(backend, {})
    except Exception as exc:
        raise TransferSetupError(f"cannot create NIXL backend {backend!r}: {err(exc)}") from exc
    return agent

