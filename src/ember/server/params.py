"""From an OpenAI request to the engine's `SamplingParams`, with every check a client can fail
reported as a 400 naming the parameter."""

from __future__ import annotations

import dataclasses

from ember.sampling_params import SEED_MAX, SamplingParams
from ember.server.errors import BadRequestError
from ember.server.protocol import SamplingFields
from ember.structured_output.params import StructuredOutputsParams

MAX_N = 128
LOGIT_BIAS_LIMIT = 100.0
_PARAM_NAMES = {f.name for f in dataclasses.fields(SamplingParams)}


def build_sampling_params(
    request: SamplingFields,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    vocab_size: int,
    prompt_logprobs: int | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """The engine parameters of one choice (n is handled by the caller, one sequence each);
    ``structured_outputs``: the request's constraint, already checked
    (`ember.server.structured_outputs`)."""
    if not 1 <= request.n <= MAX_N:
        raise BadRequestError(f"n must be between 1 and {MAX_N}, got {request.n}", param="n")
    try:
        return SamplingParams(
            n=1,
            temperature=_default(request.temperature, 1.0),
            top_p=_default(request.top_p, 1.0),
            top_k=_default(request.top_k, 0),
            min_p=_default(request.min_p, 0.0),
            seed=request.seed,
            max_tokens=max_tokens,
            min_tokens=request.min_tokens,
            stop=list(_stop_strings(request.stop)),
            stop_token_ids=_token_ids(request.stop_token_ids, vocab_size, "stop_token_ids"),
            ignore_eos=request.ignore_eos,
            presence_penalty=_default(request.presence_penalty, 0.0),
            frequency_penalty=_default(request.frequency_penalty, 0.0),
            repetition_penalty=_default(request.repetition_penalty, 1.0),
            logit_bias=_logit_bias(request.logit_bias, vocab_size),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=request.skip_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
            structured_outputs=structured_outputs,
        )
    except ValueError as exc:
        # SamplingParams names the field first ("temperature must be ..."): use it as param.
        field = str(exc).split(" ", 1)[0]
        raise BadRequestError(str(exc), param=field if field in _PARAM_NAMES else None) from exc


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index` of n: a seeded request's choices use seed, seed + 1, ... (back to 0 past
    the largest seed the engine holds) so they differ from each other yet each is
    reproducible."""
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + index) % (SEED_MAX + 1))


def check_context_length(
    num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, param: str
) -> None:
    """400 when the prompt, or the prompt plus the requested completion, exceeds the context;
    `param` names the prompt's field."""
    if num_prompt_tokens >= max_model_len:
        raise BadRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {num_prompt_tokens} tokens. Please reduce the length of the prompt.",
            param=param,
            code="context_length_exceeded",
        )
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise BadRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"prompt, {max_tokens} in the completion). Please reduce the length of the prompt "
            "or of the completion.",
            param="max_tokens",
            code="context_length_exceeded",
        )


def _default(value, fallback):
    return fallback if value is None else value


def _stop_strings(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if any(not s for s in stops):
        raise BadRequestError("stop strings must not be empty", param="stop")
    return stops


def _token_ids(ids: list[int] | None, vocab_size: int, param: str) -> list[int]:
    for token_id in ids or ():
        if not 0 <= token_id < vocab_size:
            raise BadRequestError(
                f"token id {token_id} is outside the vocabulary [0, {vocab_size})", param=param
            )
    return list(ids or ())


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    if not bias:
        return None
    result = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise BadRequestError(
                f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
            ) from None
        if not 0 <= token_id < vocab_size:
            raise BadRequestError(
                f"logit_bias token id {token_id} is outside the vocabulary [0, {vocab_size})",
                param="logit_bias",
            )
        if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            raise BadRequestError(
                f"logit_bias values must be in [-100, 100], got {value}", param="logit_bias"
            )
        result[token_id] = float(value)
    return result
