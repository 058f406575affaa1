"""The KV-transfer core, by stage: `plan/` (what a pull reads), `lease/` (the producer's leases and
the reader's confirmation), `nixl/` (the transport over NIXL); `rank_transfer` runs them for one rank.

Pure Python + torch + nixl. Nothing in this package may import Ray or vLLM:
the vLLM connector and the synthetic engine are thin adapters over it.
"""
