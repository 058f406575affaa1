"""The KV-transfer core: topology, layouts, transport, aggregation, breakers, leases.

Pure Python + torch + nixl. Nothing in this package may import Ray or vLLM:
the vLLM connector and the synthetic engine are thin adapters over it.
"""
