"""The producer's side of a pull: leases on sent blocks (lease, lease board, producer), the
reader's confirmation of them (confirm), checksums (integrity) and the readers' notices (notify)."""
