"""The connector's scheduler half: which local and remote blocks a decode request pulls."""

from types import SimpleNamespace

from actors.engine.vllm.connector.scheduler import ConnectorScheduler


def request(params, prompt_len, computed=0, req_id="d-1"):
    return SimpleNamespace(request_id=req_id, kv_transfer_params=params, prompt_token_ids=list(range(prompt_len)),
                           num_computed_tokens=computed)


def blocks(ids):
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def params(block_ids, num_tokens, block_size=16, tp=1, dcp=1):
    return {"do_remote_prefill": True, "remote_engine_id": "P", "remote_block_ids": block_ids,
            "num_tokens": num_tokens, "tp_size": tp, "dcp_size": dcp, "block_size": block_size}


def recv_of(sched, req, local_ids):
    count, is_async = sched.get_num_new_matched_tokens(req, req.num_computed_tokens)
    assert is_async
    sched.update_state_after_alloc(req, blocks(local_ids), count)
    (spec,) = sched.build_connector_meta().recv.values()
    return spec


def test_prefix_cached_blocks_are_not_read_again():
    sched = ConnectorScheduler("D", 1, 1, 1, block_size=16, lease_ttl_s=30)
    req = request(params([10, 11, 12, 13], 60), prompt_len=61, computed=32)
    spec = recv_of(sched, req, [0, 1, 2, 3])
    assert (spec.local_block_ids, spec.remote_block_ids, spec.num_tokens) == ((2, 3), (12, 13), 60)
    assert req.kv_transfer_params["do_remote_prefill"] is False  # a retry must not pull again


def test_smaller_remote_blocks_map_ratio_to_one():
    sched = ConnectorScheduler("D", 1, 1, 1, block_size=32, lease_ttl_s=30)
    req = request(params(list(range(20, 28)), 60, block_size=8), prompt_len=61, computed=32)
    spec = recv_of(sched, req, [5, 6, 7])
    # local block 6 (tokens 32..63) receives remote blocks 24..27 (four of 8 tokens)
    assert spec.local_block_ids == (6,) and spec.remote_block_ids == (24, 25, 26, 27)


def test_dcp_blocks_cover_block_size_times_dcp_tokens():
    sched = ConnectorScheduler("D", 2, 1, 2, block_size=16, lease_ttl_s=30)  # local dcp 2: 32 tokens a block
    req = request(params([40, 41], 60, tp=2, dcp=2), prompt_len=61)
    spec = recv_of(sched, req, [3, 4, 5])
    assert spec.local_block_ids == (3, 4) and spec.remote_block_ids == (40, 41)
    # dcp sizes differ: token rows are addressed from the first block on, cached or not
    other = ConnectorScheduler("D", 2, 1, 1, block_size=16, lease_ttl_s=30)
    req = request(params([40, 41], 60, tp=2, dcp=2), prompt_len=61, computed=16)
    spec = recv_of(other, req, [3, 4, 5, 6])
    assert spec.local_block_ids == (3, 4, 5, 6) and spec.remote_block_ids == (40, 41)


def test_malformed_params_are_computed_locally():
    sched = ConnectorScheduler("D", 1, 1, 1, block_size=16, lease_ttl_s=30)
    req = request(params([1], 60), prompt_len=61)  # one block cannot hold 60 tokens
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert req.kv_transfer_params["do_remote_prefill"] is False and sched.stats["bad_params"] == 1


def test_small_pulls_load_synchronously_up_to_the_knob():
    sched = ConnectorScheduler("D", 1, 1, 1, block_size=16, lease_ttl_s=30, sync_load_max_tokens=60)
    small = request(params([10, 11, 12, 13], 60), prompt_len=61)
    assert sched.get_num_new_matched_tokens(small, 0) == (60, False)  # sync: vLLM schedules it now
    sched.update_state_after_alloc(small, blocks([0, 1, 2, 3]), 60)
    large = request(params([10, 11, 12, 13, 14], 61), prompt_len=62, req_id="d-2")
    assert sched.get_num_new_matched_tokens(large, 0) == (61, True)
    sched.update_state_after_alloc(large, blocks([4, 5, 6, 7]), 61)
    recv = sched.build_connector_meta().recv
    assert recv["d-1"].sync and not recv["d-2"].sync
    assert (sched.stats["sync_loads"], sched.stats["async_loads"]) == (1, 1)


def test_a_failed_sync_load_says_in_its_prefill_stats_that_nothing_was_pulled():
    from vllm.v1.metrics.stats import PrefillStats

    sched = ConnectorScheduler("D", 1, 1, 1, block_size=16, lease_ttl_s=30, sync_load_max_tokens=1000)
    ok, bad = request(params([10, 11], 30), prompt_len=31), request(params([12, 13], 30), prompt_len=31, req_id="d-2")
    for req, local in ((ok, [0, 1]), (bad, [2, 3])):
        req.prefill_stats = PrefillStats()
        req.prefill_stats.set(31, 0, 30)  # as vLLM set it when it admitted the request
        count, _ = sched.get_num_new_matched_tokens(req, 0)
        sched.update_state_after_alloc(req, blocks(local), count)
    bad.num_computed_tokens = 0  # vLLM rewound it (_handle_invalid_blocks) before telling the connector
    sched.update_connector_output(SimpleNamespace(invalid_block_ids={3}))
    assert (bad.prefill_stats.num_cached_tokens, bad.prefill_stats.num_computed_tokens) == (0, 31)
    assert ok.prefill_stats.num_cached_tokens == 30 and sched.stats["sync_failures"] == 1
    sched.request_finished(ok, [0, 1])  # finished: no longer watched (its blocks may be reused)
    sched.update_connector_output(SimpleNamespace(invalid_block_ids={0}))
    assert ok.prefill_stats.num_cached_tokens == 30
