"""NIXL (UCX) behind `TransportBase`: the agent, its binding and checks, prepared handles,
`NixlTransport`, and the huge pages DRAM caches are backed by. Only this folder imports nixl."""
