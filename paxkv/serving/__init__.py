"""The OpenAI-compatible HTTP server over the engine (paxkv serve)."""
