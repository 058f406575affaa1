"""The lease confirmation and `verify` over real NIXL, between two spawned processes (no Ray).

A producer rank and a decode rank (`SyntheticRank` over `NixlTransport`) live
in two child processes started with multiprocessing spawn; the parent passes
handshake payloads and commands over pipes, with a timeout on every call. The
producer's owner never calls its agent while the reader pulls: its NIXL
progress thread serves both the data READ and the READ of its lease board.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import time
import traceback
from typing import Any, Callable

import pytest

pytest.importorskip("nixl")
pytest.importorskip("torch")

CTX = mp.get_context("spawn")
TOKENS = list(range(100, 165))  # 65 tokens: 9 blocks of 8
pytestmark = pytest.mark.timeout(240)


def _serve(conn: Any) -> None:
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
                    conn.send(("ok", fn(state, *args)))
                except BaseException as exc:
                    conn.send(("err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
            elif os.getppid() != parent:
                break
    finally:
        if "rank" in state:
            state["rank"].shutdown()


def c_rank(state: dict, engine_id: str, role: str, verify: str, corrupt: float) -> bytes:
    from actors.kv.faults import FaultPolicy
    from actors.engine.synthetic.rank import RankConfig, SyntheticModel, SyntheticRank

    cfg = RankConfig(engine_id=engine_id, role=role, model=SyntheticModel(num_layers=2, num_kv_heads=2),
                     tp_rank=0, tp_size=1, block_size=8, num_blocks=64, layout="HND", read_timeout_s=3.0,
                     verify=verify)
    state["payloads"] = {}
    state["rank"] = SyntheticRank(cfg, directory=lambda e, p, rs: [state["payloads"][(e, p, r)] for r in rs],
                                  faults=FaultPolicy(corrupt_rate=corrupt))
    return state["rank"].handshake()


def c_payloads(state: dict, payloads: dict) -> None:
    state["payloads"].update(payloads)


def c_write(state: dict, req: str, ids: list[int], ttl: float | None) -> None:
    state["rank"].write_prompt(req, TOKENS, ids, seed=5, lease_ttl_s=ttl)


def c_hold(state: dict, req: str, ids: list[int]) -> None:
    state["rank"].xfer.hold(req, ids, ttl_s=60.0)


def c_lease_end(state: dict, req: str, limit: float) -> str | None:
    """Step the producer (what its engine loop does) until `req`'s lease ends: how it ended
    ("released": the readers' notices; "expired": its TTL), None if it did not within `limit`."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        step = state["rank"].poll()
        if req in step.released or req in step.expired:
            return "released" if req in step.released else "expired"
        time.sleep(0.005)
    return None


def _start(state: dict, req: str, params: dict, ids: list[int]) -> None:
    from actors.transfer_params import TransferParams

    state["rank"].start_pull(req, TransferParams.parse(params), TOKENS, ids, seed=5)


def c_pull(state: dict, req: str, params: dict, ids: list[int], limit: float) -> tuple:
    _start(state, req, params, ids)
    return c_pull_wait(state, req, limit)


def c_pull_until_no_record(state: dict, req: str, params: dict, ids: list[int], limit: float) -> int:
    """Start a pull and step it until its reader READ the producer's lease record and found none (no
    lease granted yet): how many times it found none (0: it never got there; -1: the pull ended)."""
    _start(state, req, params, ids)
    rank = state["rank"]
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        out = rank.poll()
        if req in out.finished or req in out.failed:
            return -1
        pull = rank.xfer._pulls.get(req)  # RankTransfer's own record of the pull: it READs the record again
        if pull is not None and pull.retries > 0:
            return pull.retries
        time.sleep(0.0005)
    return 0


def c_pull_wait(state: dict, req: str, limit: float) -> tuple:
    rank = state["rank"]
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        out = rank.poll()
        if req in out.finished:
            t = rank.xfer.timings[req]
            return ("ok", out.finished[req].mismatches, t.confirm_s, rank.xfer.integrity["checked_blocks"])
        if req in out.failed:
            return ("failed", out.failed[req].reason, len(out.failed[req].invalid_block_ids))
        time.sleep(0.0005)
    return ("pending",)


class Peer:
    def __init__(self) -> None:
        self.conn, child = CTX.Pipe()
        self.proc = CTX.Process(target=_serve, args=(child,), daemon=True)
        self.proc.start()
        child.close()

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float = 60.0) -> Any:
        self.conn.send((fn, args))
        if not self.conn.poll(timeout):
            raise AssertionError(f"{fn.__name__} did not answer in {timeout} s")
        status, value = self.conn.recv()
        if status != "ok":
            raise AssertionError(value)
        return value

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


@pytest.fixture
def pair():
    peers: list[Peer] = []

    def make(verify: str = "off", corrupt: float = 0.0) -> tuple[Peer, Peer]:
        p, d = Peer(), Peer()
        peers.extend([p, d])
        hp = p.call(c_rank, "P", "prefill", verify, corrupt)
        d.call(c_rank, "D", "decode", verify, 0.0)
        d.call(c_payloads, {("P", 0, 0): hp})
        return p, d

    yield make
    for peer in peers:
        peer.close()
    assert not [p.proc.pid for p in peers if p.proc.is_alive()]


REMOTE = list(range(40, 31, -1))  # 9 blocks, descending (vLLM-like)
LOCAL = list(range(3, 12))


def params() -> dict:
    return {"remote_engine_id": "P", "remote_block_ids": REMOTE, "tp_size": 1, "pp_size": 1, "dcp_size": 1,
            "block_size": 8, "num_tokens": len(TOKENS)}


def test_a_confirmed_pull_verifies_and_then_releases_the_lease(pair):
    p, d = pair(verify="all")
    p.call(c_write, "r1", REMOTE, 30.0)
    status, mismatches, confirm_s, checked = d.call(c_pull, "r1", params(), LOCAL, 20.0)
    assert (status, mismatches) == ("ok", 0)
    assert checked == math.ceil(len(TOKENS) / 8) and confirm_s < 1.0
    assert p.call(c_lease_end, "r1", 10.0) == "released"  # by the reader's notice (its TTL is 30 s)


def test_a_pull_after_the_lease_expired_fails_closed(pair):
    p, d = pair()
    p.call(c_write, "r1", REMOTE, 0.2)
    assert p.call(c_lease_end, "r1", 10.0) == "expired"  # the producer's clock alone decides; then the pull
    result = d.call(c_pull, "r1", params(), LOCAL, 20.0)
    assert result[0] == "failed" and "lease had ended" in result[1] and result[2] == len(LOCAL)


def test_a_reader_before_the_lease_grant_waits_for_the_record(pair):
    p, d = pair()
    p.call(c_write, "r1", REMOTE, None)  # prefilled; the lease comes later
    # the reader's data READs are done and it found no lease record at the producer: it waits for one
    assert d.call(c_pull_until_no_record, "r1", params(), LOCAL, 20.0) > 0
    p.call(c_hold, "r1", REMOTE)  # then the lease is granted (well within the reader's 3 s read timeout)
    assert d.call(c_pull_wait, "r1", 20.0)[:2] == ("ok", 0)
    assert p.call(c_lease_end, "r1", 10.0) == "released"  # by the reader's notice


def test_verify_all_catches_a_flipped_byte_over_nixl(pair):
    p, d = pair(verify="all", corrupt=1.0)
    p.call(c_write, "r1", REMOTE, 30.0)
    result = d.call(c_pull, "r1", params(), LOCAL, 20.0)
    assert result[0] == "failed" and "integrity check failed" in result[1]
    assert p.call(c_lease_end, "r1", 10.0) == "released"  # the ok=false notice frees it at once
