"""A reasoning model's replies in the OpenAI server: `think` reads reasoning between `<think>`
and `</think>` (Qwen3, DeepSeek-R1) as it streams, `think_grammar` holds the answer after it
to a structured-output constraint, `selection` names the formats (--reasoning-parser).
gpt-oss's harmony channels are `ember.server.harmony`'s."""
