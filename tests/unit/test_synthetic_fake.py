"""Synthetic ranks over FakeTransport, in one process: the pull pipeline and every fault switch."""

import math

import pytest

from actors.kv.faults import NO_FAULTS, FaultPolicy
from actors.engine.synthetic.rank import FailedPull, PulledKV, RankConfig, SyntheticModel, SyntheticRank
from actors.transfer_params import TransferParams
from tests.unit.fake_transport import FakeFabric, FakeTransport

TOKENS = list(range(100, 137))  # 37 tokens: several blocks plus a partial one


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make_engine(fabric, directory, engine_id, role, model, tp=1, pp=1, dcp=1, layout="HND",
                block_size=8, clock=None, faults=NO_FAULTS):
    ranks = []
    for p in range(pp):
        for t in range(tp):
            cfg = RankConfig(engine_id=engine_id, role=role, model=model, tp_rank=t, tp_size=tp,
                             pp_rank=p, pp_size=pp, dcp_size=dcp, block_size=block_size,
                             num_blocks=32, layout=layout)
            rank = SyntheticRank(
                cfg, directory=lambda e, p_, rs: [directory[(e, p_, r)] for r in rs],
                transport_factory=lambda name, geo: FakeTransport(name, geo, fabric, clock=clock or Clock()),
                clock=clock or Clock(), faults=faults,
            )
            directory[(engine_id, p, t)] = rank.handshake()
            ranks.append(rank)
    return ranks


def one_to_one():
    """A 1-rank prefill engine "P" and a 1-rank decode engine "D" of a 2-layer, 2-head model."""
    model = SyntheticModel(num_layers=2, num_kv_heads=2)
    fabric, directory = FakeFabric(), {}
    return (fabric, directory, make_engine(fabric, directory, "P", "prefill", model),
            make_engine(fabric, directory, "D", "decode", model))


def prefill(ranks, req, ttl=60.0):
    cfg = ranks[0].cfg
    n_blocks = math.ceil(math.ceil(len(TOKENS) / cfg.dcp_size) / cfg.block_size)
    block_ids = list(range(31, 31 - n_blocks, -1))  # reversed ids: nothing contiguous by accident
    for r in ranks:
        r.write_prompt(req, TOKENS, block_ids, seed=7, lease_ttl_s=ttl)
    return {"remote_engine_id": cfg.engine_id, "remote_block_ids": block_ids, "tp_size": cfg.tp_size,
            "pp_size": cfg.pp_size, "dcp_size": cfg.dcp_size, "block_size": cfg.block_size,
            "num_tokens": len(TOKENS)}


def decode(ranks, req, params, polls=20):
    cfg = ranks[0].cfg
    n_blocks = math.ceil(math.ceil(len(TOKENS) / cfg.dcp_size) / cfg.block_size)
    block_ids = list(range(2, 2 + n_blocks))
    for r in ranks:
        r.start_pull(req, TransferParams.parse(params), TOKENS, block_ids, seed=7)
    results = [{} for _ in ranks]
    for _ in range(polls):
        for i, r in enumerate(ranks):
            out = r.poll()
            results[i].update({k: ("ok", v) for k, v in out.finished.items()})
            results[i].update({k: ("failed", v) for k, v in out.failed.items()})
        if all(req in res for res in results):
            break
    return [res.get(req) for res in results]


CASES = [
    # (P tp, D tp, heads, mla, P dcp, D dcp, P pp, P block, D block, P layout, D layout)
    (1, 1, 4, False, 1, 1, 1, 8, 8, "HND", "HND"),
    (1, 2, 4, False, 1, 1, 1, 8, 8, "HND", "HND"),
    (2, 1, 4, False, 1, 1, 1, 8, 8, "NHD", "HND"),
    (2, 4, 4, False, 1, 1, 1, 4, 8, "HND", "NHD"),
    (4, 2, 4, False, 1, 1, 1, 2, 8, "HND", "HND"),
    (4, 1, 2, False, 1, 1, 1, 8, 8, "HND", "HND"),  # P replicated (tp > heads)
    (1, 4, 2, False, 1, 1, 1, 8, 8, "HND", "HND"),  # D replicated
    (2, 1, 4, False, 1, 1, 2, 8, 8, "HCND", "HCND"),  # pp=2, vLLM CPU packing
    (2, 2, 1, True, 1, 2, 1, 8, 8, "ND", "ND"),  # MLA, D dcp
    (2, 1, 1, True, 2, 1, 1, 8, 8, "ND", "ND"),  # MLA, P dcp
    (2, 2, 1, True, 2, 2, 1, 4, 8, "ND", "ND"),  # MLA, both dcp, block ratio 2
]


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_pull_verifies_every_element_and_frees_producer_blocks(case):
    p_tp, d_tp, heads, mla, p_dcp, d_dcp, p_pp, p_bs, d_bs, p_layout, d_layout = case
    model = SyntheticModel(num_layers=4, num_kv_heads=heads, head_size=32, is_mla=mla)
    fabric, directory = FakeFabric(), {}
    p = make_engine(fabric, directory, "P", "prefill", model, p_tp, p_pp, p_dcp, p_layout, p_bs)
    d = make_engine(fabric, directory, "D", "decode", model, d_tp, 1, d_dcp, d_layout, d_bs)
    params = prefill(p, "r1")
    results = decode(d, "r1", params)
    assert [r[0] for r in results] == ["ok"] * len(d), results
    assert [r[1].mismatches for r in results] == [0] * len(d)
    for rank in p:  # every prefill rank heard all its readers and released the lease
        out = rank.poll()
        assert rank.leases.held() == 0, (rank.reader_name, out, rank.leases.counters())
        assert rank.leases.counters()["released_by_readers"] == 1
    # colocated reference: the same decode shape writing the prompt itself
    ref = make_engine(FakeFabric(), {}, "C", "both", model, d_tp, 1, d_dcp, d_layout, d_bs)
    for i, r in enumerate(ref):
        n_blocks = math.ceil(math.ceil(len(TOKENS) / d_dcp) / d_bs)
        r.write_prompt("c", TOKENS, list(range(n_blocks)), seed=7)
        _, sums = r.read_back(TOKENS, list(range(n_blocks)), seed=7)
        assert results[i][1].checksums == sums


def test_corrupted_byte_is_detected():
    fabric, directory, p, d = one_to_one()
    params = prefill(p, "r1")
    p[0].tensors[1][0][params["remote_block_ids"][1], 1, 3, 5] += 1.0
    (result,) = decode(d, "r1", params)
    assert result[0] == "ok" and result[1].mismatches == 1


@pytest.mark.parametrize("fault", ["handshake_fails", "setup_fails", "state_err", "poll_raises", "dead"])
def test_fault_switch_fails_the_request_with_invalid_blocks(fault):
    model = SyntheticModel(num_layers=2, num_kv_heads=2)
    fabric, directory, clock = FakeFabric(), {}, Clock()
    p = make_engine(fabric, directory, "P", "prefill", model, clock=clock)
    d = make_engine(fabric, directory, "D", "decode", model, clock=clock)
    params = prefill(p, "r1", ttl=30.0)
    target = p[0] if fault == "dead" else d[0]
    setattr(target.transport.faults, fault, True)
    (result,) = decode(d, "r1", params)
    assert result[0] == "failed", result
    assert result[1].invalid_block_ids and result[1].reason
    assert d[0].transport.in_flight() == 0 and d[0].xfer.pulls_in_flight == 0 and not d[0]._pulls
    # the producer frees its blocks: at once when told, at the latest when the lease expires
    p[0].transport.faults.dead = False
    p[0].poll()
    if p[0].leases.held():
        clock.now += 31.0
        assert p[0].poll().expired == ("r1",)
    assert p[0].leases.held() == 0


def test_slow_transfer_finishes_after_n_polls_and_times_out_when_too_slow():
    model = SyntheticModel(num_layers=2, num_kv_heads=2)
    fabric, directory, clock = FakeFabric(), {}, Clock()
    p = make_engine(fabric, directory, "P", "prefill", model, clock=clock)
    d = make_engine(fabric, directory, "D", "decode", model, clock=clock)
    d[0].transport.faults.slow_polls = 3
    params = prefill(p, "r1")
    (result,) = decode(d, "r1", params, polls=10)
    assert result[0] == "ok" and d[0].transport.stats.requests_done == 2  # the data READ, then the lease record
    d[0].transport.faults.slow_polls = 10**6
    params = prefill(p, "r2")
    block_ids = [2, 3, 4, 5, 6]
    d[0].start_pull("r2", TransferParams.parse(params), TOKENS, block_ids, seed=7)
    assert d[0].poll().failed == {}
    clock.now += d[0].transport.read_timeout_s + 1
    out = d[0].poll()
    assert "not done after" in out.failed["r2"].reason


def test_forged_block_ids_never_reach_the_wire():
    fabric, directory, p, d = one_to_one()
    params = prefill(p, "r1")
    params["remote_block_ids"] = [0, 1, 2, 3, 99]
    (result,) = decode(d, "r1", params)
    assert result[0] == "failed" and "BlockRangeError" in result[1].reason
    assert d[0].transport.stats.reads_posted == 0


def test_engine_restart_gets_a_fresh_handshake():
    fabric, directory, p, d = one_to_one()
    assert decode(d, "r1", prefill(p, "r1"))[0][0] == "ok"
    old_agent = p[0].agent_name
    p[0].shutdown()
    p = make_engine(fabric, directory, "P", "prefill", p[0].cfg.model)  # same engine id, new agent
    assert d[0].drop_engine("P") == 1
    assert decode(d, "r2", prefill(p, "r2"))[0][0] == "ok"
    assert d[0].transport.peer(("P", 0, 0)).agent_name != old_agent


def test_shutdown_releases_everything_once():
    fabric, directory, p, d = one_to_one()
    params = prefill(p, "r1")
    d[0].transport.faults.slow_polls = 100
    d[0].start_pull("r1", TransferParams.parse(params), TOKENS, [2, 3, 4, 5, 6], seed=7)
    stats = d[0].shutdown()
    assert stats["transport_in_flight"] == 0 and stats["peers"] == 0
    d[0].shutdown()  # idempotent
    with pytest.raises(Exception, match="shut down"):
        d[0].transport.poll()


def test_fault_policy_fails_its_requests_without_reading_and_tells_known_producers():
    model = SyntheticModel(num_layers=2, num_kv_heads=2)
    fabric, directory = FakeFabric(), {}
    faults = FaultPolicy(rate=0.5, seed=3)
    doomed = next(f"r{i}" for i in range(100) if faults.fails(f"r{i}"))
    spared = next(f"r{i}" for i in range(100) if not faults.fails(f"r{i}"))
    p = make_engine(fabric, directory, "P", "prefill", model)
    d = make_engine(fabric, directory, "D", "decode", model, tp=2, faults=faults)
    assert [r[0] for r in decode(d, spared, prefill(p, spared))] == ["ok", "ok"]  # connects D to P
    results = decode(d, doomed, prefill(p, doomed))
    assert [r[0] for r in results] == ["failed", "failed"]  # every rank agrees on the verdict
    assert all("fault injected" in r[1].reason and r[1].invalid_block_ids for r in results)
    # only the spared request was read: per rank its data READ, then its lease record
    assert sum(r.transport.stats.reads_posted for r in d) == 2 * 2
    assert doomed in p[0].poll().released and p[0].leases.held() == 0


def test_fault_policy_rate_holds_per_request():
    faults = FaultPolicy(rate=0.1, seed=0)
    hits = sum(faults.fails(f"req-{i}") for i in range(10_000))
    assert 900 < hits < 1100
    assert not any(FaultPolicy().fails(f"req-{i}") for i in range(1000))
    with pytest.raises(ValueError):
        FaultPolicy(rate=1.5)


def test_notice_before_the_lease_is_applied_when_the_lease_arrives():
    from actors.kv.lease.notify import ReaderNotice

    model = SyntheticModel(num_layers=2, num_kv_heads=2)
    fabric, directory = FakeFabric(), {}
    p = make_engine(fabric, directory, "P", "prefill", model)
    fabric.mailboxes[p[0].agent_name].append(ReaderNotice("early", "D:0:0", 1, True).encode())
    p[0].xfer.hold("other", [5], ttl_s=10)  # a held lease makes the step read notices
    step = p[0].xfer.step()
    assert (step.released, step.expired) == ((), ())  # no lease for "early" yet: kept, not lost
    p[0].xfer.hold("early", [1, 2], ttl_s=10)
    assert p[0].leases.held() == 1 and p[0].leases.counters()["released_by_readers"] == 1
    assert p[0].xfer.step().released == ("early",)  # the early release shows in the next step



def test_handshake_and_descriptor_lists_are_prepared_once_per_engine():
    model = SyntheticModel(num_layers=2, num_kv_heads=4)
    fabric, directory = FakeFabric(), {}
    p = make_engine(fabric, directory, "P", "prefill", model, tp=2)
    d = make_engine(fabric, directory, "D", "decode", model, tp=1, layout="NHD")
    asked = []
    for r in d:  # count directory lookups
        inner = r.directory
        r.directory = lambda e, pp, ranks, inner=inner: asked.append((e, pp, tuple(ranks))) or inner(e, pp, ranks)
    assert decode(d, "r1", prefill(p, "r1"))[0][0] == "ok"
    first = d[0].stats()
    for i in range(2, 5):
        assert decode(d, f"r{i}", prefill(p, f"r{i}"))[0][0] == "ok"
    again = d[0].stats()
    assert asked == [("P", 0, (0, 1))]  # one handshake with both producer ranks, ever
    # per producer rank: our KV list + theirs, our landing rows for its lease records + its board
    assert (first["handshakes"], first["lists_prepared"]) == (2, 8)
    assert (again["handshakes"], again["lists_prepared"]) == (2, 8)
    assert again["reads_posted"] == 4 * 2 * 2  # 4 pulls x 2 producer ranks x (data, lease record)


def test_forged_local_block_ids_never_reach_the_wire():
    fabric, directory, p, d = one_to_one()
    params = TransferParams.parse(prefill(p, "r1"))
    d[0]._pulls["r1"] = (TOKENS, 7, [2, 3, 4, 5, 32])
    d[0].xfer.start_pull("r1", params.pull_request([2, 3, 4, 5, 32]), d[0].directory)  # 32: not ours
    out = d[0].poll()
    assert "local block id 32 outside [0, 32)" in out.failed["r1"].reason
    assert d[0].transport.stats.reads_posted == 0
    assert "r1" in p[0].poll().released  # the producer heard we gave up


def test_release_is_reported_by_the_next_step_once():
    model = SyntheticModel(num_layers=2, num_kv_heads=2)
    p = make_engine(FakeFabric(), {}, "P", "prefill", model)
    xfer = p[0].xfer
    xfer.hold("r1", [4, 5], ttl_s=60)
    assert xfer.release("r1") == [4, 5] and xfer.leases.held() == 0
    assert xfer.step().released == ("r1",)
    assert xfer.step().released == ()
    assert xfer.release("r1") == []  # nothing held: nothing reported
    assert xfer.step().released == () and not xfer.needs_step


def test_a_restarted_producer_under_new_agents_is_handshaken_again():
    fabric, directory, p, d = one_to_one()
    assert decode(d, "r1", prefill(p, "r1"))[0][0] == "ok"
    d[0].xfer.refresh_peers({("P", 0, 0): p[0].agent_name})  # same agent: nothing happens
    assert d[0].transport.peers() == [("P", 0, 0)]
    p[0].shutdown()
    p = make_engine(fabric, directory, "P", "prefill", p[0].cfg.model)
    d[0].xfer.refresh_peers({("P", 0, 0): p[0].agent_name})
    assert d[0].transport.peers() == []
    assert decode(d, "r2", prefill(p, "r2"))[0][0] == "ok"
    assert d[0].transport.peer(("P", 0, 0)).agent_name == p[0].agent_name
