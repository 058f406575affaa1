"""raypd's vLLM general plugin: vLLM's shared-memory readers sleep instead of spinning, only in
processes a raypd engine started (a plain vLLM server in the same environment runs as shipped)."""

import inspect

import pytest

pytest.importorskip("vllm")

from vllm.distributed.device_communicators import shm_broadcast  # noqa: E402

from actors.engine.config import EngineConfig  # noqa: E402
from actors.engine.options import engine_actor_options  # noqa: E402
from actors.engine.vllm import plugin  # noqa: E402


@pytest.fixture
def spin(monkeypatch):
    monkeypatch.setattr(shm_broadcast.SpinCondition, "__init__", shm_broadcast.SpinCondition.__init__)
    monkeypatch.setattr(shm_broadcast.SpinCondition, "wait", shm_broadcast.SpinCondition.wait)
    for attr in ("_raypd_original_init", "_raypd_original_wait", "_raypd_busy_loop_s"):
        if attr in shm_broadcast.SpinCondition.__dict__:
            monkeypatch.delattr(shm_broadcast.SpinCondition, attr)
    return shm_broadcast.SpinCondition


def busy_loop_default(cls) -> float:
    return inspect.signature(cls.__init__).parameters["busy_loop_s"].default


def test_a_process_no_raypd_engine_started_keeps_vllms_spin(spin, monkeypatch):
    monkeypatch.delenv(plugin.BUSY_LOOP_ENV, raising=False)
    plugin.register()
    assert busy_loop_default(spin) == 1


def test_auto_on_a_cpu_host_makes_readers_sleep_on_the_notification(spin, monkeypatch):
    monkeypatch.setenv(plugin.BUSY_LOOP_ENV, "auto")
    plugin.register()
    plugin.register()  # vLLM may load plugins again in one process
    assert busy_loop_default(spin) == 0.0


def test_an_engines_setting_reaches_its_processes_environment_and_none_leaves_vllm_as_shipped():
    cfg = EngineConfig(role="both", backend="vllm", engine_id="e", model="m")
    env = engine_actor_options(cfg)["runtime_env"]["env_vars"]
    tuned = engine_actor_options(cfg.model_copy(update={"cpu": cfg.cpu.model_copy(update={"shm_busy_loop_s": 0.0})}))["runtime_env"]["env_vars"]
    assert (plugin.BUSY_LOOP_ENV in env, tuned[plugin.BUSY_LOOP_ENV]) == (False, "0.0")


def test_a_writer_never_drops_a_notification_and_a_reader_wakes_for_each(spin, monkeypatch):
    """vLLM's writer drops a notification while the previous one is in flight (SNDHWM 1); a reader
    that consumed the previous one would then sleep beside a ready message."""
    import zmq

    monkeypatch.setenv(plugin.BUSY_LOOP_ENV, "0")
    plugin.register()
    ctx = zmq.Context()
    address = "ipc:///tmp/raypd-test-spin-" + str(id(ctx))
    writer = spin(False, ctx, address)
    reader = spin(True, ctx, address)
    assert writer.local_notify_socket.getsockopt(zmq.SNDHWM) == 0
    import time

    time.sleep(0.2)  # the subscription reaches the publisher
    t0 = time.monotonic()
    writer.notify()
    reader.wait(timeout_ms=5000)
    woke_s = time.monotonic() - t0
    t1 = time.monotonic()
    reader.wait(timeout_ms=5000)  # nothing more was sent: sleeps at most the poll cap
    capped_s = time.monotonic() - t1
    for s in (writer.local_notify_socket, reader.local_notify_socket, reader.read_cancel_socket,
              reader.write_cancel_socket):
        s.close(0)
    ctx.term()
    assert (woke_s < 1.0, capped_s < 1.0) == (True, True)
