"""Planning a pull, once per remote engine: which ranks to read (topology, read plan), how their
blocks are cut into descriptors (layout, descriptors) and the prepared lists a request indexes
(pull plan); `pull_types` holds the typed objects a rank's owner hands `RankTransfer`."""
