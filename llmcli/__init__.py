"""llmcli: fast, local, quantized LLM inference on the CPU."""

__version__ = "0.1.0"
