"""RDMA over pyverbs (one-sided READ/WRITE, GPUDirect): the transport, its pure connection and
spreading plan, per-peer state, the verbs wrapper (the only pyverbs importer) and NIC topology."""
