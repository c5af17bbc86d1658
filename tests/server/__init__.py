"""Tests of `ember serve`: a real server process, driven through the openai client."""
