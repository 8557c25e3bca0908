"""vLLM KV connector (prefill/decode disaggregation, shared prefix pool).

Not implemented yet: this package is built by the vLLM issue.
"""
