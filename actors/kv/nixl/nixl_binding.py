"""How raypd creates a NIXL agent: from the binding, with UCX's progress thread asleep on an fd.

Why a progress thread. In UCX's ``peer`` error mode a READ only completes
when the *target* agent drives UCX progress too (wire-up, notifications and
the final flush travel over TCP loopback; `actors/kv/NIXL_NOTES.md`). A
producer is a vLLM worker whose one Python thread is busy computing prefill
steps: without a thread of its own, a decode engine's pull waited for the
producer's whole next prefill step (7-8 s stalls under load).

Why not `nixl._api.nixl_agent`. It hard-codes ``pthrDelay = 0``. NIXL's UCX
progress thread arms the UCX worker and ``poll()``s the worker's event fd
with a timeout of ``pthrDelay`` (µs, rounded up to whole ms): 0 becomes 1 ms,
a thread waking 1000 times a second for nothing. raypd builds the agent from
the binding (``nixlBind.nixlAgentConfig`` / ``nixlBind.nixlAgent``, the
objects `nixl_agent` wraps) with a 1 s timeout: the thread sleeps in
``poll()`` until UCX has an event (a peer's READ, a notification, a
connection) and wakes once a second otherwise (upstream keeps the timeout as
a safety net for fds UCX fails to signal). An idle agent's threads cost
~0 CPU: `benchmarks/transfer.py` measures them over an idle spell
(NIXL_NOTES.md (d)); no thread here spins.

Thread safety. With the progress thread on, NIXL creates the UCX worker
multi-threaded (``UCS_THREAD_MODE_MULTI``) whatever the agent's sync mode,
and the progress thread appends incoming notifications to a list under its
own mutex that ``getNotifs`` swaps out: notifications arrive although the
owner never progresses. The agent's own state gets
``NIXL_THREAD_SYNC_STRICT``: every API call holds the agent's lock, so a call
from another thread (a handle released by the garbage collector) can never
interleave with the owner's. The progress thread runs backend code only and
never takes that lock, so it never waits behind the owner.
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

