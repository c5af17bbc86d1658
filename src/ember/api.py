"""The offline API, shaped like vLLM's: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ember.config import engine_config
from ember.engine.model_instance import ModelInstance
from ember.engine.step_types import TokenLogprobs
from ember.sampling_params import SamplingParams
from ember.tokenizer.detokenizer import IncrementalDetokenizer

PromptType = str | list[int] | dict[str, Any]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False


class LLM:
    """A model loaded in this process. `LLM()` with no model loads the embedded SmolLM2."""

    def __init__(self, model: str | None = None, **options: Any) -> None:
        """``model``: a GGUF file, a model directory or a Hugging Face id in the local cache
        (None: the embedded SmolLM2). ``options``: the engine's, named as `ember serve`'s flags
        and vLLM's `LLM` keywords (`ember.config.ENGINE_OPTIONS`: ``max_model_len``,
        ``max_num_seqs``, ``max_num_batched_tokens``, ``gpu_memory_utilization``, ``dtype``,
        ``device``, ``seed``, ``enforce_eager``, ...); one left out keeps its default."""
        self.instance = ModelInstance(engine_config(model, **options))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.instance.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt; outputs come back in the order of the prompts."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        encoded = [self._encode(p) for p in prompt_list]
        for (_, ids), params in zip(encoded, params_list):
            self.instance.validate_prompt(ids, params)  # all checked before any is queued
        return self._run(encoded, params_list)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        tokenizer = self.instance.tokenizer
        prompts = [
            {
                "prompt_token_ids": tokenizer.encode_chat(
                    conv,
                    add_generation_prompt=add_generation_prompt,
                    **(chat_template_kwargs or {}),
                )
            }
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params)

    def _encode(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.instance.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                return prompt["prompt"], self.instance.tokenizer.encode(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        return None, [int(t) for t in prompt]

    def _run(
        self, encoded: list[tuple[str | None, list[int]]], params_list: list[SamplingParams]
    ) -> list[RequestOutput]:
        instance, tokenizer = self.instance, self.instance.tokenizer
        results: list[RequestOutput] = []
        tracked: dict[str, _Tracked] = {}
        for (text, ids), params in zip(encoded, params_list):
            base = str(next(self._ids))
            out = RequestOutput(request_id=base, prompt=text, prompt_token_ids=ids)
            results.append(out)
            for index in range(params.n):
                # Each of the n choices is its own sequence; a seeded request's choices differ.
                choice_params = params
                if params.seed is not None and index:
                    choice_params = dataclasses.replace(params, seed=params.seed + index, n=1)
                request_id = f"{base}-{index}"
                completion = CompletionOutput(index=index, text="", token_ids=[])
                if params.logprobs is not None:
                    completion.logprobs, completion.cumulative_logprob = [], 0.0
                out.outputs.append(completion)
                detok = IncrementalDetokenizer(
                    tokenizer,
                    ids,
                    skip_special_tokens=params.skip_special_tokens,
                    stop=list(params.stop),
                    include_stop_str_in_output=params.include_stop_str_in_output,
                )
                tracked[request_id] = _Tracked(completion, detok)
                instance.add_request(request_id, ids, choice_params)
        while instance.has_work():
            for update in instance.step():
                entry = tracked[update.request_id]
                entry.add(update)
                if entry.detok.finished and update.finish_reason is None:
                    instance.abort(update.request_id)  # a stop string ended it
                if entry.done:
                    entry.finalize()
        for out in results:
            out.finished = True
        return results


@dataclass
class _Tracked:
    completion: CompletionOutput
    detok: IncrementalDetokenizer
    done: bool = False

    def add(self, update) -> None:
        c = self.completion
        c.token_ids.extend(update.new_token_ids)
        if c.logprobs is not None:
            for lp in update.new_logprobs:
                if lp is not None:
                    c.logprobs.append(lp)
                    c.cumulative_logprob += lp.logprob
        c.text += self.detok.add(update.new_token_ids)
        if self.detok.finished:
            c.finish_reason, c.stop_reason, self.done = "stop", self.detok.stop_reason, True
        elif update.finish_reason is not None:
            c.finish_reason, self.done = update.finish_reason, True
            if update.finish_reason == "stop":
                c.stop_reason = update.new_token_ids[-1]

    def finalize(self) -> None:
        self.completion.text += self.detok.flush()


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # a single prompt given as token ids
    return items


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
    return params
