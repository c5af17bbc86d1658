"""Logprobs in the two shapes the OpenAI API uses.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}]}]}`. Completions: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}` with
`top_logprobs` a list of {token text: logprob} holding the sampled token too (as vLLM does); an
echoed prompt's first token has null in both. Token texts are each token decoded on its own
(special tokens kept).
"""

from __future__ import annotations

from ember.engine.step_types import TokenLogprobs
from ember.server.models import ServedModel


def _chat_entry(model: ServedModel, token_id: int, logprob: float) -> dict:
    text = model.token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(model: ServedModel, logprobs: list[TokenLogprobs]) -> dict:
    """The `logprobs` of a chat choice (or of one streamed chunk)."""
    content = []
    for lp in logprobs:
        entry = _chat_entry(model, lp.token_id, lp.logprob)
        entry["top_logprobs"] = [_chat_entry(model, t, v) for t, v in lp.top]
        content.append(entry)
    return {"content": content}


class CompletionLogprobs:
    """Builds completions logprobs chunk by chunk, keeping the running `text_offset`."""

    def __init__(self, model: ServedModel, start_offset: int = 0) -> None:
        self.model = model
        self.offset = start_offset

    def prompt(
        self,
        token_ids: list[int],
        scores: list[TokenLogprobs | None] | None = None,
        top_k: int = 0,
    ) -> dict:
        """Echoed prompt tokens: their texts and offsets, and with the engine's prompt
        logprobs (``scores``, None first) their logprobs and ``top_k`` alternatives."""
        if scores is None:
            return self._build([(t, None, None) for t in token_ids])
        items = [(token_ids[0], None, None)]
        items += [(lp.token_id, lp.logprob, lp.top[:top_k]) for lp in scores[1:]]
        return self._build(items)

    def generated(self, logprobs: list[TokenLogprobs]) -> dict:
        return self._build([(lp.token_id, lp.logprob, lp.top) for lp in logprobs])

    def _build(self, items: list[tuple[int, float | None, list[tuple[int, float]] | None]]) -> dict:
        result: dict[str, list] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        for token_id, logprob, alternatives in items:
            text = self.model.token_text(token_id)
            result["tokens"].append(text)
            result["token_logprobs"].append(logprob)
            result["text_offset"].append(self.offset)
            self.offset += len(text)
            if alternatives is None:
                result["top_logprobs"].append(None)
                continue
            top = {self.model.token_text(t): v for t, v in alternatives}
            top.setdefault(text, logprob)
            result["top_logprobs"].append(top)
        return result


def merge_completion_logprobs(parts: list[dict]) -> dict | None:
    """Concatenate the per-chunk dicts of one choice (for the non-streamed response)."""
    if not parts:
        return None
    merged: dict[str, list] = {key: [] for key in parts[0]}
    for part in parts:
        for key, values in part.items():
            merged[key].extend(values)
    return merged
