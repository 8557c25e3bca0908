"""The transports: one module each (local, shm, tcp, rdma/), all implementing
:class:`kvconnect.transfer.transports.base.Transport`. Transports never import each other."""
