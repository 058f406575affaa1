"""raypd's vLLM general plugin: how vLLM's processes wait on CPU hosts, that they end with the engine
actor that started them (`parent_death`) and, under autogroup, lead a session of their own
(`compute_group`).

vLLM runs `register` in each of its processes (engine core, workers). It changes nothing unless a
raypd engine started the process with `shm_busy_loop_s` set (`RAYPD_SHM_BUSY_LOOP_S`, from
`actors.engine.options`), so plain vLLM servers in the same environment run as shipped. With it, the
reader of vLLM's shared-memory queue (`SpinCondition`) spins `busy_loop_s` after each read before
it sleeps on its ZMQ notification; on a CPU host that spin competes with the computing worker, so 0
sleeps at once (opt-in until measured faster; docs/benchmarks.md). Sleeping is made safe: the
writer's notification socket gets no send high-water mark (with vLLM's 1 a notification can be
dropped and both processes stall), and a reader sleeps at most `POLL_CAP_MS` before it looks again.
Written against vLLM 0.32's `SpinCondition`; another version's is left alone.
"""

from __future__ import annotations

import os

from actors.engine.vllm.compute_group import leave_session
from actors.engine.vllm.parent_death import follow_parent

BUSY_LOOP_ENV = "RAYPD_SHM_BUSY_LOOP_S"
POLL_CAP_MS = 50  # the longest a reader sleeps before it looks at the buffer again
SNDHWM_UNBOUNDED = 0


def register() -> None:
    if follow_parent() is not None:  # a vLLM process below a raypd engine actor ends with its parent
        from vllm.platforms import current_platform

        leave_session(current_platform.is_cpu())  # its own scheduling group (compute_group.py)
    value = os.environ.get(BUSY_LOOP_ENV)
    if value is None:
        return  # not a raypd engine: vLLM as shipped
    if value == "auto":
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return  # a GPU step takes milliseconds on hardware of its own: the spin is vLLM's to keep
        value = "0"
    patch_spin_condition(float(value))


def patch_spin_condition(busy_loop_s: float) -> bool:
    """Readers spin `busy_loop_s` (then sleep, `POLL_CAP_MS` at a time); writers never drop a notification.
    False when vLLM's SpinCondition is not the one this was written for (left alone)."""
    import inspect

    import zmq
    from vllm.distributed.device_communicators import shm_broadcast

    spin = shm_broadcast.SpinCondition
    if getattr(spin, "_raypd_busy_loop_s", None) == busy_loop_s:
        return True  # loaded again in the same process
    original_init = spin.__dict__.get("_raypd_original_init", spin.__init__)
    original_wait = spin.__dict__.get("_raypd_original_wait", spin.wait)
    params = list(inspect.signature(original_init).parameters)
    if params != ["self", "is_reader", "context", "notify_address", "busy_loop_s"] or \
            list(inspect.signature(original_wait).parameters) != ["self", "timeout_ms"]:
        return False

    def __init__(self, is_reader, context, notify_address, busy_loop_s=busy_loop_s):  # noqa: N807
        if is_reader:
            original_init(self, True, context, notify_address, busy_loop_s=busy_loop_s)
            return
        # vLLM's writer side, with no send high-water mark (options apply to the pipes a bind creates)
        self.is_reader = False
        self.local_notify_socket = context.socket(zmq.PUB)
        self.local_notify_socket.setsockopt(zmq.SNDHWM, SNDHWM_UNBOUNDED)
        self.local_notify_socket.bind(notify_address)
        self.last_read, self.busy_loop_s = 0, 0
        self.read_cancel_socket = self.write_cancel_socket = self.poller = None

    def wait(self, timeout_ms=None):
        capped = POLL_CAP_MS if timeout_ms is None else min(timeout_ms, POLL_CAP_MS)
        return original_wait(self, timeout_ms=capped)

    spin._raypd_original_init, spin._raypd_original_wait = original_init, original_wait
    spin._raypd_busy_loop_s = busy_loop_s
    spin.__init__, spin.wait = __init__, wait
    return True
