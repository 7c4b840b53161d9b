"""`llmcli bench`: llama-bench's tests, the llmcli path beside a raw loop, TTFT, roofline; and `bench compare`."""
