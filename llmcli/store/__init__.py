"""Step 1, models on disk: references, the Hub (the only importer of huggingface_hub), the cache, GGUF headers."""
