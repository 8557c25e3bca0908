"""The cache-aware router: an OpenAI-compatible front choosing prefill and decode instances
by the KV cache they hold and their load (docs/router.md)."""
