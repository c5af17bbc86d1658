"""Tool calling for /v1/chat/completions: the request's tools checked and handed to the chat
template (`request`), the model's text read back into OpenAI tool calls by the parser of its
family (`registry`: hermes, llama3_json, mistral), whole or while it streams (`stream`)."""
