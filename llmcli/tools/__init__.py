"""Step 4's tool calls, run: the user's Python functions, MCP servers, and the loop that runs a call and feeds
its result back."""
