"""The transports: one module each (local, shm, tcp, rdma/), all implementing
:class:`kvconnect.transfer.transports.base.Transport` and each contributing one entry to
:mod:`.registry`. Transports never import each other (RDMA reaches TCP through the context)."""
