"""Handshake payload: round trip, two-phase decoding, a typed error naming each bad field."""

import json

import pytest

from actors.kv.transfer_errors import HandshakeError
from actors.kv.handshake import PROTOCOL_VERSION, CompatInfo, RankHandshake, decode_handshake
from actors.kv.plan.layout import HND, CacheGeometry

COMPAT = CompatInfo("m", "float32", 4, 2, 32, "float32", "split")
GEO = CacheGeometry(HND, 2, 0, 8, 16, 2, 32, 4, ((4096, 8192), (12288, 16384)))


def payload(**overrides):
    fields = dict(engine_id="P", role="prefill", tp_rank=1, tp_size=2, pp_rank=0, pp_size=1,
                  dcp_size=1, block_size=16, agent_name="P-a", agent_metadata=b"\x00meta",
                  geometry=GEO, compat=COMPAT)
    fields.update(overrides)
    return RankHandshake(**fields)


def mutate(fn):
    env = json.loads(payload().encode())
    fn(env)
    return json.dumps(env).encode()


def test_round_trip():
    hs = decode_handshake(payload().encode(), expect_compat_hash=COMPAT.compat_hash())
    assert hs == payload() and hs.key == ("P", 0, 1) and hs.geometry.block_bytes == 2 * 16 * 32 * 4


def test_compat_hash_covers_model_fields():
    other = CompatInfo("m", "float16", 4, 2, 32, "float16", "split")
    assert other.compat_hash() != COMPAT.compat_hash()
    assert "dtype: 'float32' vs 'float16'" in COMPAT.differences(other)


@pytest.mark.parametrize(
    "data, field",
    [
        (b"not json", "envelope"),
        (b"[1, 2]", "envelope"),
        (mutate(lambda e: e.update(protocol=PROTOCOL_VERSION + 1)), "protocol"),
        (mutate(lambda e: e.pop("compat_hash")), "compat_hash"),
        (mutate(lambda e: e.update(body=None)), "body"),
        (mutate(lambda e: e["body"].update(tp_rank="1")), "tp_rank"),
        (mutate(lambda e: e["body"].update(tp_rank=5)), "tp_rank"),
        (mutate(lambda e: e["body"].update(agent_name="")), "agent_name"),
        (mutate(lambda e: e["body"].update(agent_metadata="!!notb64")), "agent_metadata"),
        (mutate(lambda e: e["body"]["compat"].update(dtype="bf16")), "compat_hash"),
        (mutate(lambda e: e["body"]["compat"].pop("dtype")), "compat"),
        (mutate(lambda e: e["body"]["geometry"].update(num_blocks=0)), "geometry"),
        (mutate(lambda e: e["body"]["geometry"].pop("bases")), "geometry"),
    ],
)
def test_malformed_payload_names_the_field(data, field):
    with pytest.raises(HandshakeError) as err:
        decode_handshake(data)
    assert err.value.field == field


def test_incompatible_peer_is_refused_before_the_body_is_read():
    other = CompatInfo("other-model", "float32", 4, 2, 32, "float32", "split")
    with pytest.raises(HandshakeError, match="incompatible") as err:
        decode_handshake(payload(compat=other).encode(), expect_compat_hash=COMPAT.compat_hash())
    assert err.value.field == "compat_hash"
