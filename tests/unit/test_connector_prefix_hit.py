"""Decode side with a local prefix-cache hit: only the blocks after the hit are pulled, into the
blocks vLLM allocated after the cached ones.

vLLM calls `update_state_after_alloc` before it sets `request.num_computed_tokens`, so the hit
must come from `get_num_new_matched_tokens`; reading it from the request (still 0) overwrote the
cached blocks and left the later ones unread: wrong KV, wrong tokens, for every prompt whose
first blocks were cached (measured: 15 of 20 greedy streams differed on their second round).
"""

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from actors.engine.vllm.connector.scheduler import ConnectorScheduler  # noqa: E402


class Blocks:
    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self):
        return [list(self.ids)]


def params(n_tokens, remote_ids):
    return {"do_remote_prefill": True, "remote_engine_id": "P", "remote_block_ids": list(remote_ids),
            "num_tokens": n_tokens, "tp_size": 1, "block_size": 32, "remote_request_id": "r-p"}


def test_only_blocks_after_the_local_hit_are_pulled():
    sched = ConnectorScheduler("D", tp_size=1, pp_size=1, dcp_size=1, block_size=32, lease_ttl_s=30)
    prompt = list(range(100, 170))  # 70 tokens: the original 69-token prompt + the prefill's first token
    req = SimpleNamespace(request_id="r", prompt_token_ids=prompt, kv_transfer_params=params(69, [7, 8, 9]),
                          num_computed_tokens=0)
    count, asynchronous = sched.get_num_new_matched_tokens(req, 32)  # block 0 is in the local prefix cache
    assert (count, asynchronous) == (69 - 32, True)
    sched.update_state_after_alloc(req, Blocks([50, 51, 52]), count)  # vLLM has not set num_computed yet
    (spec,) = sched.build_connector_meta().recv.values()
    assert spec.local_block_ids == (51, 52) and spec.remote_block_ids == (8, 9) and spec.num_tokens == 69
    assert req.kv_transfer_params["do_remote_prefill"] is False


def test_without_a_local_hit_every_block_is_pulled():
    sched = ConnectorScheduler("D", tp_size=1, pp_size=1, dcp_size=1, block_size=32, lease_ttl_s=30)
    req = SimpleNamespace(request_id="r", prompt_token_ids=list(range(70)), kv_transfer_params=params(69, [7, 8, 9]),
                          num_computed_tokens=0)
    count, _ = sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, Blocks([50, 51, 52]), count)
    (spec,) = sched.build_connector_meta().recv.values()
    assert spec.local_block_ids == (50, 51, 52) and spec.remote_block_ids == (7, 8, 9)
