"""The offline API, shaped like vLLM's: `LLM(...).generate(prompts, SamplingParams(...))` for
one model; `Engine` for several under one memory budget (`generate(..., model=NAME)`)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Self

from ember.chat_prompt import chat_prompt_ids
from ember.chat_reasoning import ChatReasoning, check_reasoning_parser
from ember.config import MEMORY_OPTIONS, engine_config, memory_config
from ember.engine.model_instance import ModelInstance
from ember.engine.model_plan import validate_prompt
from ember.engine.model_pool import ModelPool
from ember.engine.step_types import TokenLogprobs
from ember.inputs import PROMPT_KEYS, PromptType
from ember.logprobs import Logprob, prompt_logprob_dicts
from ember.progress_bar import UseTqdm, prompt_progress
from ember.sampling_params import SamplingParams
from ember.tokenizer.detokenizer import IncrementalDetokenizer


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None
    # `LLM.chat` of a model that reasons (`ember.chat_reasoning`): the reply read as the
    # server reads it, its reasoning and its answer (None: none); `text` stays as generated.
    reasoning_content: str | None = None
    content: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # With `SamplingParams.prompt_logprobs`: None for the first prompt token, then per token
    # {token id: Logprob} of it and its top alternatives (vLLM's shape).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class Engine:
    """Several models in this process under one memory budget: `add_model` configures one
    (loaded on its first request, or by `load`), `generate(..., model=NAME)` runs on it.
    A model that does not fit puts the least recently used one to sleep (`ember.engine
    .model_pool`); `sleep`, `wake`, `load` and `unload` do it by hand. ``memory_options``:
    `ember.config.MEMORY_OPTIONS` (``gpu_memory_utilization``, ``memory_budget_bytes``,
    ``sleep_host_memory_bytes``)."""

    def __init__(self, **memory_options: Any) -> None:
        self.pool = ModelPool([], memory_config(**memory_options))
        self._ids = itertools.count()

    def close(self) -> None:
        """Unload every model: its device memory goes back now (`ModelPool.close`)."""
        self.pool.close()

    def add_model(self, name: str | None = None, model: str | None = None, **options: Any) -> str:
        """Configure ``model`` (as `LLM`'s) under ``name`` (default: the model as given);
        ``options``: the engine's (`ember.config.ENGINE_OPTIONS`). Returns the name."""
        options.setdefault("served_model_name", name)
        return self.pool.add_model(engine_config(model, **options))

    @property
    def models(self) -> list[str]:
        return list(self.pool.slots)

    def state(self, name: str) -> str:
        return self.pool.state(name).value

    def load(self, name: str) -> float:
        """Load (or wake) ``name`` now; the seconds it took."""
        return self._command(name, "load")

    def sleep(self, name: str) -> float:
        return self._command(name, "sleep")

    def wake(self, name: str) -> float:
        return self._command(name, "wake")

    def unload(self, name: str) -> float:
        return self._command(name, "unload")

    def _command(self, name: str, action: str) -> float:
        results = []
        self.pool.command(name, action, results.append)
        self.pool.wait_transitions()
        (result,) = results
        if result.status != 200:
            failure = self.pool.failure(name)
            if failure is not None:
                raise failure  # the load's own error: a bad file reads as one
            raise RuntimeError(result.message)
        return result.seconds

    def instance(self, name: str) -> ModelInstance:
        """The loaded model ``name`` (loading it first if needed)."""
        if self.pool.state(name).value != "loaded":
            self.load(name)
        instance = self.pool.instance(name)
        assert instance is not None
        return instance

    def get_tokenizer(self, name: str):
        return self.pool.slots[name].plan.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        model: str,
        use_tqdm: UseTqdm = False,
    ) -> list[RequestOutput]:
        """Generate completions on ``model`` for every prompt, in the order of the prompts;
        ``use_tqdm``: a progress bar over the prompts (off by default)."""
        plan = self.pool.slots[model].plan
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        encoded = [_encode(plan.tokenizer, p) for p in prompt_list]
        for (_, ids), params in zip(encoded, params_list):
            validate_prompt(plan, ids, params)  # all checked before any is queued
        return self._run(model, encoded, params_list, prompt_progress(use_tqdm, len(encoded)))

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        model: str,
        use_tqdm: UseTqdm = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        reasoning_parser: str | None = None,
    ) -> list[RequestOutput]:
        """Apply ``model``'s chat template (or ``chat_template``, a file or the template text)
        to each conversation, with ``tools`` and ``chat_template_kwargs`` as template
        variables, then generate. Tool calls in the replies are left as text. Where the model
        reasons (``reasoning_parser``, the server's --reasoning-parser; gpt-oss's harmony
        without it), each completion's `reasoning_content` and `content` hold the reply read
        as the server reads it."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        tokenizer = self.get_tokenizer(model)
        prompts = [
            {
                "prompt_token_ids": chat_prompt_ids(
                    tokenizer,
                    conv,
                    add_generation_prompt=add_generation_prompt,
                    tools=tools,
                    chat_template=chat_template,
                    chat_template_kwargs=chat_template_kwargs,
                )
            }
            for conv in conversations
        ]
        reasoning = ChatReasoning(tokenizer, reasoning_parser)
        outputs = self.generate(prompts, sampling_params, model=model, use_tqdm=use_tqdm)
        reasoning.read(outputs)
        return outputs

    def _run(
        self,
        model: str,
        encoded: list[tuple[str | None, list[int]]],
        params_list: list[SamplingParams],
        progress: Any | None = None,
    ) -> list[RequestOutput]:
        pool, tokenizer = self.pool, self.get_tokenizer(model)
        choices_left: dict[str, int] = {}  # prompt's request id -> its unfinished choices
        results: list[RequestOutput] = []
        tracked: dict[str, _Tracked] = {}
        owners: dict[str, RequestOutput] = {}  # request id -> its prompt's output
        for (text, ids), params in zip(encoded, params_list):
            base = str(next(self._ids))
            out = RequestOutput(request_id=base, prompt=text, prompt_token_ids=ids)
            results.append(out)
            choices_left[base] = params.n
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
                owners[request_id] = out
                pool.add_request(model, request_id, ids, choice_params)
        unfinished = set(tracked)
        while unfinished:
            pool.poll()
            rejections = pool.take_rejections()
            if rejections:
                for request_id in unfinished:
                    pool.abort(request_id)
                raise RuntimeError(rejections[0].message)
            for update in pool.step():
                entry = tracked[update.request_id]
                entry.add(update)
                owner = owners[update.request_id] if update.prompt_logprobs else None
                if owner is not None and owner.prompt_logprobs is None:  # one choice's suffice
                    owner.prompt_logprobs = prompt_logprob_dicts(
                        update.prompt_logprobs,
                        lambda t: tokenizer.decode([t], skip_special_tokens=False),
                    )
                if entry.detok.finished and update.finish_reason is None:
                    pool.abort(update.request_id)  # a stop string ended it
                if entry.done:
                    entry.finalize()
                    unfinished.discard(update.request_id)
                    prompt_id = owners[update.request_id].request_id
                    choices_left[prompt_id] -= 1
                    if progress is not None and choices_left[prompt_id] == 0:
                        progress.update(1)
        if progress is not None:
            progress.close()
        for out in results:
            out.finished = True
        return results


class LLM:
    """One model loaded in this process. `LLM()` with no model loads the embedded SmolLM2."""

    def __init__(
        self, model: str | None = None, *, reasoning_parser: str | None = None, **options: Any
    ) -> None:
        """``model``: a GGUF file, a model directory or a Hugging Face id in the local cache
        (None: the embedded SmolLM2). ``reasoning_parser``: how `chat` reads the model's
        reasoning (`ember serve`'s --reasoning-parser). ``options``: the engine's, named as
        `ember serve`'s flags and vLLM's `LLM` keywords (`ember.config.ENGINE_OPTIONS`:
        ``max_model_len``, ``max_num_seqs``, ``max_num_batched_tokens``, ``dtype``,
        ``device``, ``seed``, ``enforce_eager``, ...; and `ember.config.MEMORY_OPTIONS`:
        ``gpu_memory_utilization``, ...); one left out keeps its default."""
        check_reasoning_parser(reasoning_parser)
        self.reasoning_parser = reasoning_parser
        memory = {k: options.pop(k) for k in MEMORY_OPTIONS if k in options}
        self.engine = Engine(**memory)
        try:
            self.model_name = self.engine.add_model(
                options.pop("served_model_name", None) or model, model, **options
            )
            self.engine.load(self.model_name)
        except BaseException:
            self.engine.close()
            raise

    def close(self) -> None:
        """Give the model's device memory back now (leaving ``with LLM(...) as llm:`` does
        the same); the `LLM` serves nothing after, and tensors taken from its model must not
        be read. An `LLM` merely dropped gives its memory back once nothing refers to it."""
        engine = self.__dict__.pop("engine", None)
        if engine is not None:
            engine.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def instance(self) -> ModelInstance:
        return self.engine.instance(self.model_name)

    def get_tokenizer(self):
        return self.engine.get_tokenizer(self.model_name)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: UseTqdm = False,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt (a string, token ids, a `TextPrompt` or a
        `TokensPrompt`); outputs come back in the order of the prompts. ``use_tqdm``: a
        progress bar over the prompts, True or a tqdm-like factory (off by default)."""
        return self.engine.generate(
            prompts, sampling_params, model=self.model_name, use_tqdm=use_tqdm
        )

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: UseTqdm = False,
        *,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: apply the model's chat template (or ``chat_template``) to each
        conversation, ``tools`` and ``chat_template_kwargs`` rendered into it, then generate.
        Tool calls in the replies come back as text (the server parses them, not this); where
        the model reasons, each completion's `reasoning_content` and `content` split the reply
        (`Engine.chat`)."""
        return self.engine.chat(
            messages,
            sampling_params,
            model=self.model_name,
            use_tqdm=use_tqdm,
            chat_template=chat_template,
            chat_template_kwargs=chat_template_kwargs,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            reasoning_parser=self.reasoning_parser,
        )


def _encode(tokenizer, prompt: PromptType) -> tuple[str | None, list[int]]:
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, dict):
        unknown = sorted(set(prompt) - PROMPT_KEYS)
        if unknown:
            raise ValueError(
                f"a prompt dict may hold only 'prompt' and 'prompt_token_ids', not {unknown}"
            )
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), [int(t) for t in prompt["prompt_token_ids"]]
        if "prompt" in prompt:
            return prompt["prompt"], tokenizer.encode(prompt["prompt"])
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    return None, [int(t) for t in prompt]


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
