"""SGLang HiCache L3 storage backend.

Not implemented yet: this package is built by the SGLang issue, on top of kvconnect.store.
"""
