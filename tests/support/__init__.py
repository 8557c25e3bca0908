"""Helpers the test suite shares; conftest.py keeps the fixtures and imports from here.

- :mod:`.child`: the environment of child processes that import ``tests.support``.
- :mod:`.waiting`: polling for state another process or thread updates.
- :mod:`.leaks`: kvconnect threads and open file descriptors (the leak check).
- :mod:`.hardware`: which devices and data paths this machine has.
- :mod:`.conformance`: the conformance checks every transport's suite runs, and a target in a
  child process.
- :mod:`.dealer`: the type of the ``raw_dealer`` fixture.
- :mod:`.fakes`: stand-ins for hardware in unit tests.
- :mod:`.store_worker`, :mod:`.prefill_peer`: child processes (``python -m tests.support.…``).

Helpers that ``kvconnect bench`` or ``kvconnect demo`` need too live in the library and tests
import them from there: ``kvconnect.store.launch`` (processes, clusters), ``kvconnect.bench.etcd``,
``kvconnect.bench.tiny_llama``, ``kvconnect.bench.vllm_servers``.
"""
