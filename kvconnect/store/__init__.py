"""The distributed KV-cache store: a master that holds metadata only (``master/``), store servers
that own the memory (``server.py``), and ``StoreClient`` (``client.py``), embedded in the engine,
which moves value bytes straight between its buffers and the servers' memory with the transfer
engine. ``kvconnect master|store|serve|status|demo`` run its processes (``commands.py``,
``demo.py``); docs/store.md describes it.
"""
