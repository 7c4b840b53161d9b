"""Measuring what a model does with a task: tool calling on BFCL-format items (`llmcli eval tools`)."""
