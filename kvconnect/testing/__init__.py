"""The public test kit for code built on kvconnect.

- :mod:`kvconnect.testing.peer`: a transfer-engine peer in a child process (``PeerProcess``).
- :mod:`kvconnect.testing.conformance`: checks any transport must pass.
"""
