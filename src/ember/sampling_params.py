"""Per-request generation parameters, shaped like vLLM's so users can switch."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from ember.structured_output.params import StructuredOutputsParams

# What the engine's per-row tensors hold: token ids, counts and top_k as int32, the seed as int64.
INT32_MAX = 2**31 - 1
SEED_MAX = 2**63 - 1


@dataclass
class SamplingParams:
    """How to generate the completion of one prompt.

    `temperature=0` means greedy. `seed` makes sampling reproducible whatever else is in the
    batch. `stop` strings are cut from the returned text; `stop_token_ids` end generation too.
    `structured_outputs` holds the output to a JSON schema, a regex, a choice or a grammar
    (`guided_decoding` is its older vLLM name); the output ends when that is complete.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    # Per prompt token after the first: its logprob given the tokens before it, and this many
    # alternatives (vLLM's meaning); None: off.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # moved to structured_outputs

    def __post_init__(self) -> None:
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("structured_outputs and guided_decoding: give one, not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k < 0:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first invalid field (the message starts with its name).

        Besides the meaning of each field, the bounds are what the engine can hold: integers
        fit its int32 columns (the seed its int64 one), and floats are finite.
        """
        _check_int("n", self.n, 1, INT32_MAX)
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be finite and non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:  # False for NaN too
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, 0, INT32_MAX)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens is not None:
            # 0 only to score a prompt without generating (its prompt logprobs).
            low = 0 if self.prompt_logprobs is not None else 1
            _check_int("max_tokens", self.max_tokens, low, INT32_MAX)
        _check_int("min_tokens", self.min_tokens, 0, INT32_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise ValueError(
                f"repetition_penalty must be finite and positive, got {self.repetition_penalty}"
            )
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, 0, INT32_MAX, "entries")
        for token_id, bias in (self.logit_bias or {}).items():
            _check_int("logit_bias", token_id, 0, INT32_MAX, "keys")
            if not math.isfinite(bias):
                raise ValueError(f"logit_bias values must be finite, got {bias}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, 20)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, 0, 20)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, SEED_MAX)
        # Stop strings cross to the engine process as UTF-8, which has no lone surrogates.
        if not all(isinstance(text, str) and _is_utf8(text) for text in self.stop):
            raise ValueError("stop strings must be valid Unicode text (no lone surrogates)")
        if self.structured_outputs is not None:
            try:
                self.structured_outputs.validate()
            except ValueError as exc:
                raise ValueError(f"structured_outputs is invalid: {exc}") from None
            if not all(_is_utf8(text) for text in self.structured_outputs.texts()):
                raise ValueError(
                    "structured_outputs must be valid Unicode text (no lone surrogates)"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0
            or self.frequency_penalty != 0
            or self.repetition_penalty != 1
        )


def _check_int(name: str, value: int, low: int, high: int, part: str = "") -> None:
    """ValueError unless `value` is an integer (not a bool) in [low, high]; `part`: which
    part of `name` it is ("entries", "keys"), when not `name` itself."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and low <= value <= high:
        return
    what = f"{name} {part} must be integers" if part else f"{name} must be an integer"
    raise ValueError(f"{what} in [{low}, {high}], got {value!r}")


def _is_utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True
