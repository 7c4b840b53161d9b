"""`llmcli serve`: an OpenAI-compatible HTTP server over one model (the `serve` extra: Starlette, uvicorn)."""
