"""Structured output: a request's output held to a JSON schema, a regex, a choice or a grammar.

- `params`: what a request asks (`StructuredOutputsParams`, on `SamplingParams`), checked for
  shape only; importable without llguidance.
- `grammar`: that request as an llguidance grammar, and its validation (the front end's check);
  as a Lark grammar too, which `lark`'s pieces nest in a larger one (a reasoning model's reply).
- `compiler`: per model, the llguidance tokenizer (built on the first structured request) and
  the compiled grammars, as one `GrammarMatcher` per request.
- `matcher`: one request's grammar state, which has consumed exactly its recorded outputs.
- `bitmask`: per step, the allowed tokens of the rows that have a grammar, filled on the CPU
  while the forward pass runs and applied to those rows' logits on the device.
"""
