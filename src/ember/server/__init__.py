"""The front-end process: an OpenAI-compatible HTTP server in front of the engine process.

Module map, from the socket up:

- `engine_client`: spawns the engine process, sends it token ids, routes its outputs to handlers.
- `generation`: one request's sequences (prompts x n): detokenization, stop strings, metrics.
- `serving_completions`, `serving_chat`: the two OpenAI endpoints, whole or streamed;
  `tool_calls/`: tools into the chat template, the model's calls back into `tool_calls`;
  `harmony/`: gpt-oss's channels into reasoning, content and calls; `reasoning/`: `<think>`
  blocks into reasoning; `reply`: one reader per choice, whichever reads it; `reply_syntax`: a
  request's reply format, its readers and the grammar that holds only its answer.
- `protocol` (request schemas), `params` (-> SamplingParams), `prompts` (-> token ids),
  `logprobs` (the two OpenAI shapes), `responses`, `sse`, `connection` (client disconnects).
- `routes`: every endpoint; `app`: the app factory; `serve`: uvicorn with a SIGTERM drain.
- `engine_supervisor`: a lost engine replaced, with backoff, up to a limit.
- `lifecycle` (loading / ready / draining, /health), `models` (tokenizers, served names),
  `metrics` (Prometheus), `errors` (OpenAI error JSON), `auth`, `body_limit`, `progress`,
  `config`, `state`.
"""
