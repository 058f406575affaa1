"""Integration tests of `actors.kv.nixl.nixl_agent.NixlAgent` across real processes.

Every NIXL agent lives in a child process started with multiprocessing
*spawn* (never in the pytest process, so a wedged UCX call cannot hang the
test runner). The parent drives the children over pipes with a timeout on every
call and always reaps them: killed peers are joined, the rest are asked to stop
and killed if they do not. No Ray; loopback only. Between calls a child makes
no NIXL call at all: what a peer needs from it (serving READs, taking
notifications) is done by NIXL's progress thread.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("nixl")
torch = pytest.importorskip("torch")

CTX = mp.get_context("spawn")
CALL_TIMEOUT = 60.0
BLOCK = 16 << 10
SHARED_NBYTES = 4 << 20  # 256 blocks of 16 KiB

pytestmark = pytest.mark.timeout(180)


# --------------------------------------------------------------------------- #
# Child side: a tiny command server hosting one NixlAgent
# --------------------------------------------------------------------------- #


def _serve(conn: Any) -> None:
    """Run `fn(state, *args)` for each message (the agent is not called in between)."""
    state: dict[str, Any] = {}
    parent = os.getppid()
    try:
        while True:
            if conn.poll(0.2):
                msg = conn.recv()
                if msg is None:
                    break
                fn, args = msg
                try:
                    reply = ("ok", fn(state, *args))
                except BaseException as exc:  # report everything to the parent
                    reply = ("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
                conn.send(reply)
            elif os.getppid() != parent:  # parent died: do not linger
                break
    finally:
        agent = state.get("agent")
        if agent is not None:
            agent.shutdown()


def _pattern(nbytes: int, seed: int) -> "torch.Tensor":
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def rows(addr: int, length: int, count: int = 1, stride: int | None = None) -> "np.ndarray":
    """One strided descriptor row: `count` descriptors of `length` bytes, `stride` apart."""
    import numpy as np

    return np.array([[addr, length, stride or length, count]], dtype=np.uint64)


def c_init(state: dict, name: str, nbytes: int, seed: int) -> int:
    from actors.kv.nixl.nixl_agent import NixlAgent

    buf = _pattern(nbytes, seed) if seed >= 0 else torch.zeros(nbytes, dtype=torch.uint8)
    agent = NixlAgent(name)
    agent.register([(buf.data_ptr(), nbytes)])
    state.update(agent=agent, buf=buf, transfers={}, prepared={})  # state keeps buf alive
    return buf.data_ptr()


def c_metadata(state: dict) -> bytes:
    return state["agent"].metadata()


def c_add_remote(state: dict, meta: bytes) -> str:
    return state["agent"].add_remote(meta)


def c_add_remote_error(state: dict, meta: bytes) -> str:
    from actors.kv.transfer_errors import HandshakeError

    try:
        state["agent"].add_remote(meta)
    except HandshakeError as exc:
        return f"HandshakeError:{exc.field}"
    return "no error"


def c_remove_remote(state: dict, name: str) -> bool:
    return state["agent"].remove_remote(name)


def c_send_notif(state: dict, peer: str, msg: bytes) -> None:
    state["agent"].send_notif(peer, msg)


def c_collect_notifs(state: dict, want: int, timeout: float) -> dict[str, list[bytes]]:
    agent, got, deadline = state["agent"], {}, time.monotonic() + timeout
    while time.monotonic() < deadline and sum(map(len, got.values())) < want:
        for k, v in agent.get_notifs().items():
            got.setdefault(k, []).extend(v)
        time.sleep(0.001)
    return got


def _block_plan(nblocks: int, layout: str, seed: int) -> tuple[list[int], list[int]]:
    """(local block ids, remote block ids) for a read of `nblocks` blocks."""
    if layout in ("one", "contig"):
        ids = list(range(nblocks))
        return ids, ids
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(nblocks, generator=g).tolist(), torch.randperm(nblocks, generator=g).tolist()


def c_read(
    state: dict,
    peer: str,
    raddr: int,
    nbytes: int,
    remote_seed: int,
    layout: str,
    notif: bytes,
    limit: float = 20.0,
) -> dict[str, Any]:
    """READ `nbytes` of the peer's buffer into ours by descriptor index; compare with the pattern."""
    agent, buf = state["agent"], state["buf"]
    buf.zero_()
    if layout == "one":
        lids, rids, blk = [0], [0], nbytes
    else:
        lids, rids = _block_plan(nbytes // BLOCK, layout, 7)
        blk = BLOCK
    key = (peer, raddr, nbytes, blk)
    if key not in state["prepared"]:  # prepared once, reused by later reads
        state["prepared"][key] = (agent.prepare_local(rows(buf.data_ptr(), blk, nbytes // blk)),
                                  agent.prepare_remote(peer, rows(raddr, blk, nbytes // blk)))
    lp, rp = state["prepared"][key]
    t0 = time.perf_counter()
    x = agent.read(lp, lids, rp, rids, notif)
    st = agent.check(x)
    deadline = time.monotonic() + limit
    while st == "PROC" and time.monotonic() < deadline:
        time.sleep(0.0002)
        st = agent.check(x)
    elapsed = time.perf_counter() - t0
    num_descs = x.num_descs
    agent.release(x)
    expected = _pattern(nbytes, remote_seed)
    got = buf[: len(lids) * blk].view(-1, blk)
    want = expected[: len(rids) * blk].view(-1, blk)
    # local block lids[k] must hold remote block rids[k]
    equal = bool(torch.equal(got[torch.tensor(lids)], want[torch.tensor(rids)]))
    return {"state": st, "equal": equal, "elapsed": elapsed, "num_descs": num_descs}


def c_post(state: dict, peer: str, raddr: int, nbytes: int, notif: bytes) -> tuple[int, str]:
    agent, buf = state["agent"], state["buf"]
    key = (peer, raddr, nbytes, nbytes)
    if key not in state["prepared"]:
        state["prepared"][key] = (agent.prepare_local(rows(buf.data_ptr(), nbytes)),
                                  agent.prepare_remote(peer, rows(raddr, nbytes)))
    lp, rp = state["prepared"][key]
    x = agent.read(lp, [0], rp, [0], notif)
    state["transfers"][id(x)] = x
    return id(x), agent.check(x)


def c_poll(state: dict, tid: int, limit: float) -> tuple[str, float, str]:
    """Poll a posted transfer until DONE/ERR or `limit` seconds."""
    agent, x = state["agent"], state["transfers"][tid]
    t0 = time.monotonic()
    st = agent.check(x)
    while st == "PROC" and time.monotonic() - t0 < limit:
        time.sleep(0.001)
        st = agent.check(x)
    return st, time.monotonic() - t0, type(x.error).__name__ if x.error else ""


def c_release(state: dict, tid: int) -> None:
    state["agent"].release(state["transfers"].pop(tid))


def c_busy(state: dict, seconds: float) -> tuple[float, float]:
    """Compute in Python for `seconds`, holding the GIL and never calling the agent
    (a prefill step); returns when the spell started and ended (CLOCK_MONOTONIC)."""
    start = time.monotonic()
    end, x = start + seconds, 0
    while time.monotonic() < end:
        x += 1
    return start, time.monotonic()


def c_reads_timed(state: dict, peer: str, raddr: int, nbytes: int, remote_seed: int, count: int,
                  limit: float) -> list[dict[str, Any]]:
    """`count` READs one after another, each polled until DONE/ERR or `limit` seconds."""
    out = []
    for i in range(count):
        res = c_read(state, peer, raddr, nbytes, remote_seed, "shuffled", f"busy-{i}".encode(), limit)
        res["ended"] = time.monotonic()
        out.append(res)
    return out


# --------------------------------------------------------------------------- #
# Parent side
# --------------------------------------------------------------------------- #


class ChildError(AssertionError):
    pass


class Peer:
    def __init__(self, name: str) -> None:
        self.name = name
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=_serve, args=(child,), name=f"nixl-{name}", daemon=True)
        self.proc.start()
        child.close()

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float = CALL_TIMEOUT) -> Any:
        self.send(fn, *args)
        return self.result(timeout)

    def send(self, fn: Callable[..., Any], *args: Any) -> None:
        self.conn.send((fn, args))

    def result(self, timeout: float = CALL_TIMEOUT) -> Any:
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.name}: no answer within {timeout}s")
        status, value = self.conn.recv()
        if status == "err":
            raise ChildError(f"{self.name}: {value}")
        return value

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self.proc.join(15)
        if self.proc.is_alive():
            self.kill()
        self.conn.close()


@pytest.fixture
def spawn_peer() -> Iterator[Callable[[str], Peer]]:
    peers: list[Peer] = []

    def make(name: str) -> Peer:
        peer = Peer(name)
        peers.append(peer)
        return peer

    yield make
    for peer in peers:
        peer.close()
    leftovers = [p.proc.pid for p in peers if p.proc.is_alive()]
    assert not leftovers, f"child processes left behind: {leftovers}"


@pytest.fixture(scope="module")
def shared_pair() -> Iterator[tuple[Peer, Peer, int]]:
    """One holder/reader pair reused by the tests that do not kill anything."""
    peers: list[Peer] = []

    def make(name: str) -> Peer:
        peer = Peer(name)
        peers.append(peer)
        return peer

    try:
        yield _pair(make, SHARED_NBYTES)
    finally:
        for peer in peers:
            peer.close()
    assert not [p.proc.pid for p in peers if p.proc.is_alive()]


def _pair(spawn_peer: Callable[[str], Peer], nbytes: int, holder: str = "holder"):
    """A holder with a patterned buffer and a reader that loaded its metadata."""
    h, r = spawn_peer(holder), spawn_peer("reader")
    h.send(c_init, holder, nbytes, 1)
    r.send(c_init, "reader", nbytes, -1)
    raddr = h.result()
    r.result()
    assert r.call(c_add_remote, h.call(c_metadata)) == holder
    return h, r, raddr


# --------------------------------------------------------------------------- #
# Tests
# --------------------------------------------------------------------------- #


def test_read_bytes_and_notifications(shared_pair):
    h, r, raddr = shared_pair
    nbytes = SHARED_NBYTES

    res = r.call(c_read, "holder", raddr, nbytes, 1, "one", b"req-1:done")
    assert res["state"] == "DONE"
    assert res["equal"]
    # the READ's notification reaches the block owner, keyed by the reader's name
    assert h.call(c_collect_notifs, 1, 10.0) == {"reader": [b"req-1:done"]}

    # standalone notifications both ways (the holder needs the reader's metadata)
    assert h.call(c_add_remote, r.call(c_metadata)) == "reader"
    h.call(c_send_notif, "reader", b"lease-expired:42")
    r.call(c_send_notif, "holder", b"ping")
    assert r.call(c_collect_notifs, 1, 10.0) == {"holder": [b"lease-expired:42"]}
    assert h.call(c_collect_notifs, 1, 10.0) == {"reader": [b"ping"]}


@pytest.mark.parametrize("layout", ["one", "contig", "shuffled"])
def test_reads_by_descriptor_index_move_the_right_bytes(shared_pair, layout):
    h, r, raddr = shared_pair
    nbytes = SHARED_NBYTES
    for i in range(2):  # the second read reuses the prepared lists
        res = r.call(c_read, "holder", raddr, nbytes, 1, layout, f"n{i}".encode())
        assert res["state"] == "DONE", res
        assert res["equal"], res
    assert res["num_descs"] == (1 if layout == "one" else nbytes // BLOCK)
    assert h.call(c_collect_notifs, 2, 10.0) == {"reader": [b"n0", b"n1"]}


def test_reads_complete_while_the_owner_thread_computes(shared_pair):
    """The block owner's one Python thread computes (holding the GIL, no NIXL call)
    for the whole test: its NIXL progress thread serves the READs and takes their
    notifications, each READ well within 100 ms (without that thread: never)."""
    h, r, raddr = shared_pair
    h.send(c_busy, 4.0)
    time.sleep(0.3)  # the spell has begun
    reads = r.call(c_reads_timed, "holder", raddr, SHARED_NBYTES, 1, 5, 2.0)
    start, end = h.result()
    assert [(x["state"], x["equal"]) for x in reads] == [("DONE", True)] * 5
    assert all(start < x["ended"] < end for x in reads), (start, end, [x["ended"] for x in reads])
    assert max(x["elapsed"] for x in reads) < 0.1, [x["elapsed"] for x in reads]
    assert h.call(c_collect_notifs, 5, 10.0) == {"reader": [f"busy-{i}".encode() for i in range(5)]}


@pytest.mark.parametrize("when", ["before_read", "while_pending"])
def test_killed_peer_is_err_and_agent_stays_usable(spawn_peer, when):
    nbytes = 1 << 20
    h, r, raddr = _pair(spawn_peer, nbytes, holder="victim")
    meta = h.call(c_metadata)
    warm = r.call(c_read, "victim", raddr, nbytes, 1, "one", b"warm")
    assert warm["state"] == "DONE" and warm["equal"]

    if when == "before_read":
        h.kill()
        tid, _ = r.call(c_post, "victim", raddr, nbytes, b"after-death")
    else:
        # Frozen (SIGSTOP: its progress thread too), the holder cannot complete
        # a READ's final handshake, so one stays in flight until it dies.
        os.kill(h.proc.pid, signal.SIGSTOP)
        tid = None
        for attempt in range(8):
            t, _ = r.call(c_post, "victim", raddr, nbytes, f"p{attempt}".encode())
            state, _, _ = r.call(c_poll, t, 0.5)
            if state == "PROC":
                tid = t
                break
            assert state == "DONE"
            r.call(c_release, t)
        assert tid is not None, "no READ stayed in flight while the holder was stalled"
        h.kill()

    assert h.proc.exitcode == -signal.SIGKILL
    state, waited, error = r.call(c_poll, tid, 30.0)
    assert state == "ERR", (state, waited)
    assert waited < 10.0
    assert error == "nixlRemoteDisconnectError"
    r.call(c_release, tid)

    # the dead peer can be forgotten, and cannot be loaded again
    assert r.call(c_remove_remote, "victim") is True
    assert r.call(c_remove_remote, "victim") is False
    assert r.call(c_add_remote_error, meta) == "HandshakeError:metadata"

    # the same reader agent still works with a healthy peer
    h2 = spawn_peer("healthy")
    raddr2 = h2.call(c_init, "healthy", nbytes, 5)
    assert r.call(c_add_remote, h2.call(c_metadata)) == "healthy"
    res = r.call(c_read, "healthy", raddr2, nbytes, 5, "contig", b"ok")
    assert res["state"] == "DONE" and res["equal"]
    assert h2.call(c_collect_notifs, 1, 10.0) == {"reader": [b"ok"]}


# ---- single-process scenarios (still in a spawned child) -------------------- #


def c_shutdown_scenario(state: dict) -> dict[str, Any]:
    """Two agents in one process; count NIXL release calls across two shutdowns."""
    import collections

    import numpy as np

    from actors.kv.transfer_errors import TransportClosedError
    from actors.kv.nixl.nixl_agent import NixlAgent

    calls: collections.Counter[str] = collections.Counter()

    class Counting:
        def __init__(self, inner: Any) -> None:
            self._inner = inner

        def __getattr__(self, name: str) -> Any:
            attr = getattr(self._inner, name)
            if not callable(attr):
                return attr

            def wrapped(*a: Any, **k: Any) -> Any:
                calls[name] += 1
                return attr(*a, **k)

            return wrapped

    a, b = NixlAgent("a"), NixlAgent("b")
    a._nixl = Counting(a._nixl)  # before any handle is created
    src = _pattern(1 << 20, 3)
    dst1, dst2 = torch.zeros(1 << 19, dtype=torch.uint8), torch.zeros(1 << 19, dtype=torch.uint8)
    b.register([(src.data_ptr(), src.numel())])
    a.register([(dst1.data_ptr(), dst1.numel())])
    a.register([(dst2.data_ptr(), dst2.numel())])
    a.add_remote(b.metadata())
    lp = a.prepare_local(np.concatenate([rows(dst1.data_ptr(), 4096), rows(dst2.data_ptr(), 4096)]))
    rp = a.prepare_remote("b", rows(src.data_ptr(), 4096, count=2))
    done = a.read(lp, [0, 1], rp, [0, 1], b"x")
    while a.check(done) == "PROC":  # b's progress thread serves the READ
        time.sleep(0.0002)
    kept = a.read(lp, [0], rp, [1])  # left for shutdown to release
    kept2 = a.read(lp, [1], rp, [0])
    assert len(a._transfers) == 3
    a.release(done)
    a.release(done)  # idempotent per handle
    before = dict(calls)
    a.shutdown()
    first = dict(calls)
    a.shutdown()
    second = dict(calls)

    raised = {}
    probes = {
        "register": lambda: a.register([(dst1.data_ptr(), 16)]),
        "metadata": a.metadata,
        "add_remote": lambda: a.add_remote(b.metadata()),
        "remove_remote": lambda: a.remove_remote("b"),
        "make_connection": lambda: a.make_connection("b"),
        "prepare_local": lambda: a.prepare_local(rows(dst1.data_ptr(), 16)),
        "prepare_remote": lambda: a.prepare_remote("b", rows(src.data_ptr(), 16)),
        "read": lambda: a.read(lp, [0], rp, [0]),
        "check": lambda: a.check(kept),
        "release": lambda: a.release(kept),
        "send_notif": lambda: a.send_notif("b", b"x"),
        "get_notifs": a.get_notifs,
    }
    for name, probe in probes.items():
        try:
            probe()
            raised[name] = "no error"
        except TransportClosedError:
            raised[name] = "TransportClosedError"
        except Exception as exc:  # noqa: BLE001
            raised[name] = type(exc).__name__
    b.shutdown()

    def delta(after: dict, base: dict, key: str) -> int:
        return after.get(key, 0) - base.get(key, 0)

    return {
        "released_before_shutdown": before.get("releaseXferReq", 0),
        "xfer_releases": delta(first, before, "releaseXferReq"),
        "dlist_releases": delta(first, before, "releasedDlistH"),
        "deregs": delta(first, before, "deregisterMem"),
        "invalidations": delta(first, before, "invalidateRemoteMD"),
        "second_shutdown_calls": {k: v for k, v in second.items() if v != first.get(k)},
        "flags": [kept.released, kept2.released, lp.released, rp.released],
        "closed": a.closed,
        "raised": raised,
    }


def test_shutdown_is_idempotent_and_releases_everything_once(spawn_peer):
    out = spawn_peer("solo").call(c_shutdown_scenario)
    assert out["released_before_shutdown"] == 1  # `done`, released once despite two calls
    assert out["xfer_releases"] == 2  # `kept` and `kept2`
    assert out["dlist_releases"] == 2  # lp, rp
    assert out["deregs"] == 2  # two registrations
    assert out["invalidations"] == 1  # remote "b"
    assert out["second_shutdown_calls"] == {}
    assert out["flags"] == [True, True, True, True]
    assert out["closed"] is True
    assert set(out["raised"].values()) == {"TransportClosedError"}, out["raised"]


def c_validation_scenario(state: dict) -> dict[str, str]:
    import numpy as np

    from actors.kv.transfer_errors import KVTransferError
    from actors.kv.nixl.nixl_agent import NixlAgent

    a, b = NixlAgent("va"), NixlAgent("vb")
    src = torch.ones(1 << 16, dtype=torch.uint8)
    dst = torch.zeros(1 << 16, dtype=torch.uint8)
    b.register([(src.data_ptr(), src.numel())])
    a.register([(dst.data_ptr(), dst.numel())])
    a.add_remote(b.metadata())
    lp = a.prepare_local(np.concatenate([rows(dst.data_ptr(), 4096), rows(dst.data_ptr() + 4096, 8192)]))
    rp = a.prepare_remote("vb", rows(src.data_ptr(), 4096))
    cases: dict[str, Callable[[], Any]] = {
        "local_outside_registration": lambda: a.prepare_local(rows(dst.data_ptr(), (1 << 16) + 1)),
        "local_strided_past_the_end": lambda: a.prepare_local(rows(dst.data_ptr(), 4096, count=17)),
        "local_negative_len": lambda: a.prepare_local(np.array([[dst.data_ptr(), -5, 8, 1]])),
        "local_zero_count": lambda: a.prepare_local(rows(dst.data_ptr(), 16, count=0)),
        "local_not_rows": lambda: a.prepare_local(np.array([[dst.data_ptr(), 16]])),
        "local_float_rows": lambda: a.prepare_local(np.array([[1.5, 16, 16, 1]])),
        "local_empty": lambda: a.prepare_local(np.zeros((0, 4), dtype=np.uint64)),
        "remote_outside_registration": lambda: a.prepare_remote("vb", rows(src.data_ptr(), (1 << 16) + 8)),
        "remote_strided_past_the_end": lambda: a.prepare_remote("vb", rows(src.data_ptr(), 4096, count=17)),
        "remote_unknown_agent": lambda: a.prepare_remote("nobody", rows(src.data_ptr(), 16)),
        "index_out_of_range": lambda: a.read(lp, [2], rp, [0]),
        "negative_index": lambda: a.read(lp, [-1], rp, [0]),
        "float_index": lambda: a.read(lp, [0.0], rp, [0]),
        "index_count_mismatch": lambda: a.read(lp, [0, 0], rp, [0]),
        "length_mismatch": lambda: a.read(lp, [1], rp, [0]),
        "swapped_sides": lambda: a.read(rp, [0], lp, [0]),
        "notif_not_bytes": lambda: a.read(lp, [0], rp, [0], "text"),  # type: ignore[arg-type]
        "garbage_metadata": lambda: a.add_remote(b"not metadata"),
        "empty_metadata": lambda: a.add_remote(b""),
        "own_metadata": lambda: a.add_remote(a.metadata()),
        "notify_unknown_agent": lambda: a.send_notif("nobody", b"x"),
        "register_bad_mem": lambda: a.register([(dst.data_ptr(), 16)], mem="FILE"),
        "register_not_pairs": lambda: a.register([(dst.data_ptr(),)]),
        "unknown_backend": lambda: NixlAgent("vc", backend="NOPE"),
    }
    out = {}
    for name, fn in cases.items():
        try:
            fn()
            out[name] = "no error"
        except KVTransferError as exc:
            out[name] = type(exc).__name__
        except Exception as exc:  # noqa: BLE001 - anything untyped is a failure
            out[name] = f"untyped {type(exc).__name__}"
    # a prepared list of another agent is refused
    b.add_remote(a.metadata())
    foreign = b.prepare_local(rows(src.data_ptr(), 8))
    try:
        a.read(foreign, [0], rp, [0])
        out["foreign_handle"] = "no error"
    except KVTransferError as exc:
        out["foreign_handle"] = type(exc).__name__
    a.shutdown()
    b.shutdown()
    return out


def test_bad_input_raises_typed_errors(spawn_peer):
    out = spawn_peer("val").call(c_validation_scenario)
    expected = {
        "local_outside_registration": "BlockRangeError",
        "local_strided_past_the_end": "BlockRangeError",
        "local_negative_len": "BlockRangeError",
        "local_zero_count": "BlockRangeError",
        "local_not_rows": "BlockRangeError",
        "local_float_rows": "BlockRangeError",
        "local_empty": "BlockRangeError",
        "remote_outside_registration": "BlockRangeError",
        "remote_strided_past_the_end": "BlockRangeError",
        "remote_unknown_agent": "TransferSetupError",
        "index_out_of_range": "BlockRangeError",
        "negative_index": "BlockRangeError",
        "float_index": "BlockRangeError",
        "index_count_mismatch": "TransferSetupError",
        "length_mismatch": "TransferSetupError",
        "swapped_sides": "TransferSetupError",
        "notif_not_bytes": "TransferSetupError",
        "garbage_metadata": "HandshakeError",
        "empty_metadata": "HandshakeError",
        "own_metadata": "HandshakeError",
        "notify_unknown_agent": "TransferSetupError",
        "register_bad_mem": "TransferSetupError",
        "register_not_pairs": "BlockRangeError",
        "unknown_backend": "TransferSetupError",
        "foreign_handle": "TransferSetupError",
    }
    assert out == expected
