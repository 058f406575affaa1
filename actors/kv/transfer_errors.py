"""Typed errors of the KV-transfer core.

Every error a caller can provoke with bad input is one of these, never an
AssertionError, so the layers above can map them to clear answers
(HTTP 4xx, a failed-transfer verdict, a refused registration).
"""


class KVTransferError(Exception):
    """Base class of every error raised by `actors.kv`."""


class TopologyError(KVTransferError, ValueError):
    """Two engines' parallel layouts (TP/DCP/PP/block size) cannot be mapped."""


class LayoutError(KVTransferError, ValueError):
    """A KV cache description or a block transform is inconsistent."""


class HandshakeError(KVTransferError, ValueError):
    """A handshake payload is malformed or incompatible; `field` names the culprit."""

    def __init__(self, field: str, message: str):
        super().__init__(f"handshake field {field!r}: {message}")
        self.field = field


class BlockRangeError(KVTransferError, IndexError):
    """A block id or descriptor falls outside the registered region."""


class TransferSetupError(KVTransferError, RuntimeError):
    """A READ could not be prepared or posted."""


class TransportClosedError(KVTransferError, RuntimeError):
    """The transport was used after `shutdown()`."""


class AggregationError(KVTransferError, ValueError):
    """Per-rank connector outputs (or the aggregator's settings) are malformed."""


class BreakerConfigError(KVTransferError, ValueError):
    """A circuit breaker was configured with a non-positive or non-finite parameter."""


class LeaseError(KVTransferError, ValueError):
    """A block lease was requested with bad arguments or under a req_id already held."""
