"""The llama.cpp adapter: the only importer of llama_cpp (engine, vocabulary, batch, KV cache, sampler chain, log)."""
