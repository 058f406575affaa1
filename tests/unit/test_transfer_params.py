import pytest

from actors.transfer_params import TransferParams, TransferParamsError

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
    ],
)
def test_forged_params_are_refused(change, message):
    with pytest.raises(TransferParamsError, match=message):
        TransferParams.parse({**GOOD, **change})


def test_not_a_dict():
    with pytest.raises(TransferParamsError, match="must be an object"):
        TransferParams.parse([1, 2])
