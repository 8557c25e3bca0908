"""vLLM KV connector: prefill/decode disaggregation (pull) and a shared prefix pool.

Load ``KVConnectConnector`` from ``kvconnect.vllm.connector`` (see docs/vllm.md). Importing
this package imports neither vLLM nor torch.
"""
