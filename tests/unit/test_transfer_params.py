import pytest

from actors.transfer_params import TransferParams, TransferParamsError, agent_incarnation

GOOD = dict(remote_engine_id="prefill-1", remote_block_ids=[3, 4], num_tokens=20, tp_size=1, block_size=16)


def test_good_params_parse_and_ignore_vllm_extras():
    p = TransferParams.parse({**GOOD, "remote_prefill_cached_tokens": 0})
    assert p.remote_block_ids == [3, 4] and p.pp_size == 1


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(remote_block_ids=[-1, 2]), ">= 0"),
        (dict(num_tokens=-5), "num_tokens"),
        (dict(num_tokens=100), "cannot hold 100 tokens"),
        (dict(tp_size=0), "tp_size"),
        (dict(tp_size=2, dcp_size=3), "dcp_size"),
        (dict(remote_engine_id="../etc"), "remote_engine_id"),
        (dict(remote_block_ids="1,2"), "remote_block_ids"),
        (dict(remote_incarnation="../x"), "remote_incarnation"),
    ],
)
def test_forged_params_are_refused(change, message):
    with pytest.raises(TransferParamsError, match=message):
        TransferParams.parse({**GOOD, **change})


def test_not_a_dict():
    with pytest.raises(TransferParamsError, match="must be an object"):
        TransferParams.parse([1, 2])


def test_pull_request_is_built_from_the_params():
    p = TransferParams.parse({**GOOD, "tp_size": 2, "pp_size": 2, "remote_request_id": "r-7"})
    req = p.pull_request([9, 8])
    assert (req.remote_engine_id, list(req.remote_block_ids), req.num_tokens) == ("prefill-1", [3, 4], 20)
    assert (req.remote_tp_size, req.remote_pp_size, req.remote_dcp_size) == (2, 2, 1)
    assert list(req.local_block_ids) == [9, 8] and req.remote_request_id == "r-7"
    narrowed = p.pull_request([9], remote_block_ids=[4], num_tokens=20)
    assert list(narrowed.remote_block_ids) == [4]


def test_fault_injection_is_not_a_wire_field():
    assert "inject_fault" not in TransferParams.model_fields
    p = TransferParams.parse({**GOOD, "inject_fault": True})  # ignored like any unknown key
    assert "inject_fault" not in p.model_dump()


def test_the_incarnation_is_the_suffix_every_rank_agent_of_one_engine_shares():
    p = TransferParams.parse({**GOOD, "remote_incarnation": "0a1b2c3d4e5f"})
    assert p.remote_incarnation == agent_incarnation("prefill-1-pp0-tp3-0a1b2c3d4e5f")
