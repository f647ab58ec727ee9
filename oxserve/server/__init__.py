"""The OpenAI-compatible HTTP server (`oxserve serve`)."""
