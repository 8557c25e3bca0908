"""The store master: metadata only, never value bytes."""
