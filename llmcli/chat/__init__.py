"""Step 2 and conversations: chat templates, the session that renders and asks, the chat record."""
