"""Distributed KV-cache store (master, store servers, embedded client).

Not implemented yet: this package is built by the store issue. Nothing here pretends to work.
"""
