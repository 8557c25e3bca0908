"""Utilities for testing kvconnect and code built on it.

- :mod:`kvconnect.testing.peer`: a transfer-engine peer in a child process (``PeerProcess``).
- :mod:`kvconnect.testing.conformance`: checks any transport must pass.
"""
