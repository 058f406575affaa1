"""Several real hosts on one machine: network namespaces on a private bridge, a Ray node in each.

`netns.HostNet` builds the hosts and injects link faults (partition, cap, lose); `ray_hosts.RayHosts`
starts a Ray head on host 0 and a node on every other host. The pytest fixture
(`tests/multihost/conftest.py`), the faults benchmark and `python -m benchmarks.hostnet` all use
these two classes. Addresses come from 198.18.0.0/15 (reserved for benchmarking); every name carries
the run's id, and teardown removes every namespace, link and process of the run.
"""
