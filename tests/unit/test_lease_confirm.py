"""Reads that fail closed (the lease confirmation) and KV integrity (`verify`), over FakeTransport.

A pull counts as done only once every source's lease record was READ after
the data READ and said HELD; RELEASED, no record within the read timeout, or a
checksum mismatch fail it (never a clock across nodes: the producer's expiry
runs on its own clock, the reader's timeout on its own).
"""

import math

import numpy as np
import pytest

from actors.kv.faults import NO_FAULTS, FaultPolicy
from actors.kv.lease.lease_board import BUCKET, HELD, RELEASED, LeaseBoard, find, lease_tag, parse
from actors.engine.synthetic.rank import RankConfig, SyntheticModel, SyntheticRank
from actors.transfer_params import TransferParams
from tests.unit.fake_transport import FakeFabric, FakeTransport

TOKENS = list(range(100, 137))


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def engine(fabric, directory, engine_id, role, model, clock, tp=1, layout="HND", block_size=8, verify="off",
           faults=NO_FAULTS, dcp=1):
    ranks = []
    for t in range(tp):
        cfg = RankConfig(engine_id=engine_id, role=role, model=model, tp_rank=t, tp_size=tp, block_size=block_size,
                         dcp_size=dcp, num_blocks=32, layout=layout, read_timeout_s=5.0, verify=verify)
        rank = SyntheticRank(cfg, directory=lambda e, p, rs: [directory[(e, p, r)] for r in rs],
                             transport_factory=lambda n, g: FakeTransport(n, g, fabric, read_timeout_s=5.0,
                                                                          clock=clock),
                             clock=clock, faults=faults)
        directory[(engine_id, 0, t)] = rank.handshake()
        ranks.append(rank)
    return ranks


def pair(verify="off", p_faults=NO_FAULTS, **kw):
    model = SyntheticModel(num_layers=2, num_kv_heads=kw.pop("heads", 2), is_mla=kw.pop("mla", False))
    fabric, directory, clock = FakeFabric(), {}, Clock()
    p_kw = {k[2:]: v for k, v in kw.items() if k.startswith("p_")}
    d_kw = {k[2:]: v for k, v in kw.items() if k.startswith("d_")}
    p = engine(fabric, directory, "P", "prefill", model, clock, verify=verify, faults=p_faults, **p_kw)
    d = engine(fabric, directory, "D", "decode", model, clock, verify=verify, **d_kw)
    return p, d, clock


def write(p, req, hold=True, ttl=60.0):
    cfg = p[0].cfg
    n = math.ceil(math.ceil(len(TOKENS) / cfg.dcp_size) / cfg.block_size)
    ids = list(range(31, 31 - n, -1))
    for r in p:
        r.write_prompt(req, TOKENS, ids, seed=7, lease_ttl_s=ttl if hold else None)
    return {"remote_engine_id": "P", "remote_block_ids": ids, "tp_size": cfg.tp_size, "pp_size": 1,
            "dcp_size": cfg.dcp_size, "block_size": cfg.block_size, "num_tokens": len(TOKENS)}


def start(d, req, params):
    cfg = d[0].cfg
    n = math.ceil(math.ceil(len(TOKENS) / cfg.dcp_size) / cfg.block_size)
    for r in d:
        r.start_pull(req, TransferParams.parse(params), TOKENS, list(range(2, 2 + n)), seed=7)


def poll_all(ranks, times=1):
    done, failed = {}, {}
    for _ in range(times):
        for o in [r.poll() for r in ranks]:
            done.update(o.finished)
            failed.update(o.failed)
    return done, failed


def test_a_pull_is_done_only_after_the_lease_record_said_held_and_then_the_producer_hears():
    p, d, _ = pair()
    start(d, "r1", write(p, "r1"))
    board = p[0].xfer.board
    assert find(board.records[(lease_tag("r1") % board.buckets) * BUCKET:][:BUCKET], lease_tag("r1")) == (HELD, 0)
    assert p[0].poll().released == ()  # no notice before the reader confirmed
    done, failed = poll_all(d)  # data READ done -> record READ -> HELD, in one step
    assert failed == {} and done["r1"].mismatches == 0
    assert d[0].xfer.timings["r1"].confirm_s >= 0
    assert p[0].poll().released == ("r1",) and p[0].leases.held() == 0
    slot = [parse(int(w)) for w in board.records if int(w)]
    assert slot == [(lease_tag("r1"), 0, RELEASED)]  # the record turned RELEASED as the lease ended


def test_a_lease_that_expired_before_the_read_was_confirmed_fails_the_pull():
    p, d, clock = pair()
    params = write(p, "r1", ttl=1.0)
    d[0].transport.faults.slow_polls = 1  # the reader is slow: its READ is still in flight
    start(d, "r1", params)
    assert poll_all(d) == ({}, {})
    clock.now += 2.0  # the producer's own clock: its lease ends, the engine may reuse the blocks
    assert p[0].poll().expired == ("r1",)
    done, failed = poll_all(d, times=3)
    assert done == {} and "lease had ended" in failed["r1"].reason and failed["r1"].invalid_block_ids


def test_an_aborted_lease_fails_its_reader_at_once():
    p, d, _ = pair()
    params = write(p, "r1")
    d[0].transport.faults.slow_polls = 1
    start(d, "r1", params)
    poll_all(d)
    assert p[0].abort("r1")
    assert "lease had ended" in poll_all(d, times=3)[1]["r1"].reason


def test_a_reader_faster_than_the_lease_grant_reads_the_record_again_until_it_appears():
    p, d, clock = pair()
    params = write(p, "r1", hold=False)  # prefilled, the lease not granted yet
    start(d, "r1", params)
    assert poll_all(d) == ({}, {})  # data READ done, no record yet: retry later
    clock.now += 0.01
    p[0].xfer.hold("r1", params["remote_block_ids"], ttl_s=60.0)
    done, failed = poll_all(d)
    assert failed == {} and done["r1"].mismatches == 0


def test_no_record_within_the_read_timeout_fails_the_pull():
    p, d, clock = pair()
    start(d, "r1", write(p, "r1", hold=False))
    for _ in range(3):
        assert poll_all(d) == ({}, {})
        clock.now += 1.0
    clock.now += 5.0
    assert "no lease record" in poll_all(d)[1]["r1"].reason


def test_a_full_bucket_publishes_nothing_and_a_released_slot_is_reused():
    board = LeaseBoard(num_blocks=8, heads=2, with_sums=False, buckets=1)
    for i in range(BUCKET):
        assert board.publish(f"r{i}", "off")
    assert not board.publish("one-too-many", "off") and board.full == 1
    board.release("r3")
    assert board.publish("late", "off")
    assert find(board.records, lease_tag("late")) == (HELD, 0)
    assert find(board.records, lease_tag("r3")) is None  # its slot was reused: readers fail closed
    board.release("r5")
    assert board.publish("r5", "off")  # granted again: the same slot, so no stale RELEASED twin
    assert find(board.records, lease_tag("r5")) == (HELD, 0)


@pytest.mark.parametrize("mode", ["all", "sample"])
@pytest.mark.parametrize("shape", [
    dict(),
    dict(p_tp=2, heads=4),  # 2 -> 1: two sources, half the heads each
    dict(d_tp=2, heads=4),  # 1 -> 2: each reader a head slice of the producer's blocks
    dict(p_layout="NHD", d_layout="HND", p_block_size=4, d_block_size=8),  # layout and block ratio
    dict(p_layout="HCND", d_layout="HCND"),  # vLLM CPU packing
    dict(mla=True, heads=1, p_layout="ND", d_layout="ND"),
], ids=["1to1", "2to1", "1to2", "nhd-ratio2", "hcnd", "mla"])
def test_verify_never_flags_a_clean_pull(mode, shape):
    p, d, _ = pair(verify=mode, **shape)
    for i in range(3):
        start(d, f"r{i}", write(p, f"r{i}"))
        done, failed = poll_all(d)
        assert failed == {} and len(done) == 1 and done[f"r{i}"].mismatches == 0
    checked = sum(r.xfer.integrity["checked_blocks"] for r in d)
    assert checked > 0 if mode == "all" else checked >= 0
    assert all(r.xfer.integrity["mismatched_pulls"] == 0 for r in d)


def test_verify_all_catches_a_flipped_byte_in_a_producer_block():
    p, d, _ = pair(verify="all", p_faults=FaultPolicy(corrupt_rate=1.0))
    start(d, "r1", write(p, "r1"))
    done, failed = poll_all(d)
    assert done == {} and "integrity check failed" in failed["r1"].reason
    assert failed["r1"].invalid_block_ids
    assert d[0].xfer.integrity["mismatched_pulls"] == 1
    assert p[0].poll().released == ("r1",)  # the reader gave up: the producer frees at once


def test_with_verify_off_the_same_flip_goes_unnoticed():
    p, d, _ = pair(verify="off", p_faults=FaultPolicy(corrupt_rate=1.0))
    start(d, "r1", write(p, "r1"))
    done, failed = poll_all(d)
    assert failed == {} and done["r1"].mismatches > 0  # the synthetic rank's own check sees it


def test_the_sample_both_sides_pick_is_the_same_and_about_one_in_eight():
    from actors.kv.lease.integrity import SAMPLE_EVERY, sampled

    ids = np.arange(100_000)
    picked = sampled(lease_tag("x"), ids)
    assert abs(picked.mean() - 1 / SAMPLE_EVERY) < 0.01
    assert np.array_equal(picked[ids[::7]], sampled(lease_tag("x"), ids[::7]))
    assert not np.array_equal(picked, sampled(lease_tag("y"), ids))


def test_both_ways_of_summing_words_give_one_checksum():
    import torch

    from actors.kv.lease.integrity import word_sums, word_weights

    words = torch.randint(-2**31, 2**31 - 1, (50, 1024), dtype=torch.int32)
    w = word_weights(1024, torch.device("cpu"))
    assert torch.equal(word_sums(words, w, matvec=True), word_sums(words, w, matvec=False))
    flipped = words.clone()
    flipped[7, 300] ^= 1 << 17
    assert (word_sums(flipped, w, True) != word_sums(words, w, True)).nonzero().flatten().tolist() == [7]
