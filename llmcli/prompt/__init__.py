"""Step 2, build the prompt: the GGUF's chat template rendered in a bounded Jinja sandbox."""
