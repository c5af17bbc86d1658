"""gpt-oss's "harmony" replies in the OpenAI server: `parser` splits a reply's channels into
reasoning, content and tool calls as it streams; `selection` says which models are read so
(the --reasoning-parser / --tool-call-parser flags, else the harmony tokens of the tokenizer).
The format's special tokens are `ember.tokenizer.harmony`'s."""
