"""Embeddings: llama.cpp in embedding mode, pooled vectors, cosine ranking."""
