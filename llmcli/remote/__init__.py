"""`--endpoint URL`: an OpenAI-compatible server answers instead of a local model (httpx2 lives here only)."""
