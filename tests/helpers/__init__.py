"""Reusable test helpers (tiny models, tokenizer fixtures)."""
