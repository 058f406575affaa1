"""Reader -> producer notifications: "I am done with request R's blocks".

A decode rank attaches one to each READ (NIXL delivers it when the read
completes) and sends it directly to replicas it skipped or, with ok=false,
to every source when its pull failed, so producers free blocks at once
instead of waiting for the lease to expire. `n` is how many readers the
producer rank must hear from (the reader's `dcp_consumer_count`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

PREFIX = b"raypd1|"


@dataclass(frozen=True)
class ReaderNotice:
    req_id: str
    reader: str
    readers_expected: int | None
    ok: bool

    def encode(self) -> bytes:
        body = {"req": self.req_id, "reader": self.reader, "n": self.readers_expected, "ok": self.ok}
        return PREFIX + json.dumps(body, separators=(",", ":")).encode()


def decode_notice(msg: bytes) -> ReaderNotice | None:
    """The notice in `msg`, or None for anything else (never raises: peers may be foreign)."""
    if not msg.startswith(PREFIX):
        return None
    try:
        data = json.loads(msg[len(PREFIX):])
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("req"), str) or not data["req"]:
        return None
    n = data.get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None
    reader = data.get("reader")
    return ReaderNotice(data["req"], reader if isinstance(reader, str) and reader else "?", n,
                        data.get("ok", True) is not False)
