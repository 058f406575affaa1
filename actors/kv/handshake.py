"""The versioned handshake payload one rank publishes for its peers.

Invariants: a peer of another version or of an incompatible model is a clear `HandshakeError`,
never a crash (the envelope's protocol and compatibility hash are checked before the body is
read); the compatibility hash covers what must be equal for KV bytes to mean the same thing on both
sides, while axis order, block size and TP/PP/DCP sizes may differ (the plan stage maps them). The
wire format: `RankHandshake`.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import asdict, dataclass

from actors.kv.transfer_errors import HandshakeError, LayoutError
from actors.kv.plan.layout import CacheGeometry
from actors.kv.lease.lease_board import BoardInfo

PROTOCOL_VERSION = 2  # 2: lease boards (readers confirm leases after their READ)


@dataclass(frozen=True)
class CompatInfo:
    """What two engines must agree on to exchange KV caches."""

    model_id: str
    dtype: str
    num_kv_heads: int  # total, before TP split (1 for MLA)
    num_layers: int  # total, before PP split
    head_size: int
    cache_dtype: str
    kv_packing: str  # "split" (K, V planes), "packed" (K/V inside a block) or "mla"
    is_mla: bool = False

    def __post_init__(self) -> None:
        if self.kv_packing not in ("split", "packed", "mla"):
            raise HandshakeError("kv_packing", f"must be split, packed or mla, got {self.kv_packing!r}")
        for name in ("num_kv_heads", "num_layers", "head_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise HandshakeError(name, f"must be a positive int, got {getattr(self, name)!r}")

    def compat_hash(self) -> str:
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def differences(self, other: "CompatInfo") -> list[str]:
        """Human-readable field differences, for refusal messages."""
        mine, theirs = asdict(self), asdict(other)
        return [f"{k}: {mine[k]!r} vs {theirs[k]!r}" for k in mine if mine[k] != theirs[k]]


@dataclass(frozen=True)
class RankHandshake:
    """One rank's identity and memory, as its peers need them.

    Wire format: JSON, decoded in two phases so a peer of another version or of an
    incompatible model is a clear `HandshakeError`, never a crash:

      1. envelope  {"protocol": int, "compat_hash": str, "body": {...}}
         -> protocol and compatibility hash are checked before the body is read;
      2. body      engine id, role, rank identity, agent name, agent metadata
         (base64), cache geometry (region addresses, block length, block count)
         and, for ranks that lease blocks, where their lease board lives
         (`actors.kv.lease.lease_board`: readers confirm leases there).

    The compatibility hash covers what must be equal for KV bytes to mean the same
    thing on both sides: model id, dtype, kv heads, layers, head size, cache dtype
    and the K/V packing of the layout. Axis order (HND/NHD), block size and TP/PP/DCP
    sizes may differ; the topology and layout modules map them.
    """

    engine_id: str
    role: str  # "prefill" | "decode" | "both"
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    dcp_size: int
    block_size: int
    agent_name: str
    agent_metadata: bytes
    geometry: CacheGeometry
    compat: CompatInfo
    board: BoardInfo | None = None  # None: a rank nobody reads from (decode only)

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.engine_id, self.pp_rank, self.tp_rank)

    def encode(self) -> bytes:
        body = {
            "engine_id": self.engine_id,
            "role": self.role,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "pp_rank": self.pp_rank,
            "pp_size": self.pp_size,
            "dcp_size": self.dcp_size,
            "block_size": self.block_size,
            "agent_name": self.agent_name,
            "agent_metadata": base64.b64encode(self.agent_metadata).decode(),
            "geometry": self.geometry.to_dict(),
            "compat": asdict(self.compat),
        }
        if self.board is not None:
            body["board"] = self.board.to_dict()
        envelope = {"protocol": PROTOCOL_VERSION, "compat_hash": self.compat.compat_hash(), "body": body}
        return json.dumps(envelope, separators=(",", ":")).encode()


_INT_FIELDS = ("tp_rank", "tp_size", "pp_rank", "pp_size", "dcp_size", "block_size")


def decode_envelope(data: bytes) -> tuple[int, str, dict]:
    """Phase 1: (protocol, compat_hash, body) without interpreting the body."""
    try:
        envelope = json.loads(data)
    except (TypeError, ValueError, UnicodeDecodeError) as exc:
        raise HandshakeError("envelope", f"not JSON: {exc}") from None
    if not isinstance(envelope, dict):
        raise HandshakeError("envelope", "must be a JSON object")
    protocol = envelope.get("protocol")
    if protocol != PROTOCOL_VERSION:
        raise HandshakeError("protocol", f"peer speaks version {protocol!r}, we speak {PROTOCOL_VERSION}")
    compat_hash = envelope.get("compat_hash")
    if not isinstance(compat_hash, str) or not compat_hash:
        raise HandshakeError("compat_hash", "missing")
    body = envelope.get("body")
    if not isinstance(body, dict):
        raise HandshakeError("body", "missing or not an object")
    return protocol, compat_hash, body


def decode_handshake(data: bytes, expect_compat_hash: str | None = None) -> RankHandshake:
    """Decode a payload; refuse another protocol or (if given) another compat hash."""
    _, compat_hash, body = decode_envelope(data)
    if expect_compat_hash is not None and compat_hash != expect_compat_hash:
        raise HandshakeError(
            "compat_hash", f"peer cache is incompatible ({compat_hash} vs ours {expect_compat_hash})"
        )
    for name in _INT_FIELDS:
        value = body.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise HandshakeError(name, f"must be a non-negative int, got {value!r}")
    if body["tp_rank"] >= body["tp_size"] or body["pp_rank"] >= body["pp_size"]:
        raise HandshakeError("tp_rank", "rank outside its group size")
    for name in ("engine_id", "role", "agent_name"):
        if not isinstance(body.get(name), str) or not body[name]:
            raise HandshakeError(name, "must be a non-empty string")
    try:
        metadata = base64.b64decode(body.get("agent_metadata", ""), validate=True)
    except (ValueError, TypeError) as exc:
        raise HandshakeError("agent_metadata", f"not base64: {exc}") from None
    if not metadata:
        raise HandshakeError("agent_metadata", "empty")
    try:
        compat = CompatInfo(**body["compat"])
    except HandshakeError:
        raise
    except (KeyError, TypeError) as exc:
        raise HandshakeError("compat", f"malformed: {exc}") from None
    if compat.compat_hash() != compat_hash:
        raise HandshakeError("compat_hash", "does not match the body's compat fields")
    try:
        geometry = CacheGeometry.from_dict(body["geometry"])
    except (KeyError, TypeError, ValueError, LayoutError) as exc:
        raise HandshakeError("geometry", f"malformed: {exc}") from None
    board = BoardInfo.from_dict(body["board"]) if body.get("board") is not None else None
    return RankHandshake(
        engine_id=body["engine_id"], role=body["role"], agent_name=body["agent_name"],
        agent_metadata=metadata, geometry=geometry, compat=compat, board=board,
        **{name: body[name] for name in _INT_FIELDS},
    )
