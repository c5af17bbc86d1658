"""Turns the logits of the rows that sample into token ids (and logprobs when asked).

Logit processing (logit bias, min_tokens, presence/frequency/repetition penalties, and the
grammar masks of structured output) happens here in PyTorch on the logits' device; the draw
itself is `Ops.sample`, which follows the sampling contract in docs/CONTRACTS.md, so a seeded
request gets the same tokens whatever the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from ember.config import StepLimits
from ember.engine.step_types import TokenLogprobs
from ember.layers.ops import Ops
from ember.sampling_params import SamplingParams


class LogitsMask(Protocol):
    """Tokens some rows may not draw (`ember.structured_output.bitmask.TokenMask`)."""

    def apply(self, logits: torch.Tensor) -> None:
        """Set the refused tokens' float32 logits to -inf, in place."""
        ...


class SamplingRow(Protocol):
    """What the sampler reads of one sampling row (the runner's per-request state)."""

    params: SamplingParams
    seed: int
    # Tokens this request generated before this sample.
    step: int
    prompt_token_ids: list[int]
    # Complete only where penalties are used (the runner collects the step in flight first).
    output_token_ids: list[int]
    # EOS and the request's stop ids, masked until min_tokens.
    stop_ids_until_min_tokens: tuple[int, ...]


@dataclass
class FixedSamplingRow:
    """A `SamplingRow` of given values (warm-up draws, tests)."""

    params: SamplingParams
    seed: int = 0
    step: int = 0
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    stop_ids_until_min_tokens: tuple[int, ...] = ()


class Sampler:
    def __init__(
        self, ops: Ops, vocab_size: int, device: torch.device, limits: StepLimits | None = None
    ) -> None:
        """Rows: at most ``limits.max_num_seqs`` per draw (the defaults' without limits)."""
        max_rows = (limits or StepLimits()).max_num_seqs
        self.ops = ops
        self.vocab_size = vocab_size
        self.device = device
        # Per-row parameters go up from pinned buffers: a copy from pageable memory would wait
        # for the GPU and undo the CPU/GPU overlap. Two sets, alternating, as for step inputs.
        pin = device.type == "cuda"
        self._staging = [
            {
                name: torch.zeros(max_rows, dtype=dtype, pin_memory=pin)
                for name, dtype in _ROW_FIELDS
            }
            for _ in range(2)
        ]
        self._turn = 0

    def __call__(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        mask: LogitsMask | None = None,
    ) -> tuple[torch.Tensor, list[TokenLogprobs | None] | None]:
        """``logits [B, V]`` in the model's dtype; every computation on them runs in float32.
        ``mask``: tokens refused to some rows (their grammars'), applied last; the logprobs
        are the model's own all the same."""
        params = [r.params for r in rows]
        wants_logprobs = any(p.logprobs is not None for p in params)
        needs = self._rows_to_process(rows)
        greedy = all(p.greedy for p in params)
        # Greedy rows with nothing to process (the common benchmark case) take one reduction over
        # the logits as they are; anything else computes on a float32 copy.
        raw_logits = logits if greedy and not needs else logits.float()
        processed = self._process(raw_logits, rows, needs)
        if mask is not None:
            if wants_logprobs and processed is raw_logits:
                processed = processed.clone()  # the logprobs are the model's own
            mask.apply(processed)
        if greedy:
            tokens = self.ops.greedy_argmax(processed)
        else:
            tokens = self.ops.sample(processed, *self._row_tensors(rows))
        return tokens, _gather_logprobs(
            raw_logits.float(), tokens, params
        ) if wants_logprobs else None

    def warm_up(self, logits_dtype: torch.dtype) -> None:
        """Draw once at every row count, greedy from logits of the model's dtype and of float32
        (rows with logit processing), and once at random. A draw's kernels specialise on the row
        count (the greedy argmax's chunks per row), so each variant is compiled, or inside
        `ember.kernels.compile_ahead` queued for compiling, before a request meets it: compiled
        at a step, it would stall the whole batch for the compile."""
        max_rows = len(self._staging[0]["seeds"])
        drawn = FixedSamplingRow(SamplingParams(temperature=1.0, top_p=0.9))
        for dtype in dict.fromkeys((logits_dtype, torch.float32)):
            logits = torch.zeros(max_rows, self.vocab_size, dtype=dtype, device=self.device)
            for rows in range(1, max_rows + 1):
                self.ops.greedy_argmax(logits[:rows])
        self(torch.zeros(1, self.vocab_size, dtype=logits_dtype, device=self.device), [drawn])

    def _row_tensors(self, rows: Sequence[SamplingRow]) -> list[torch.Tensor]:
        """temperature, top_k, top_p, min_p, seeds, steps as device tensors, without a sync."""
        self._turn ^= 1
        staging, n = self._staging[self._turn], len(rows)
        if n > len(staging["seeds"]):
            raise ValueError(f"{n} sampling rows exceed the sampler's {len(staging['seeds'])}")
        columns = {
            "temperature": [r.params.temperature for r in rows],
            "top_k": [r.params.top_k for r in rows],
            "top_p": [r.params.top_p for r in rows],
            "min_p": [r.params.min_p for r in rows],
            "seeds": [r.seed for r in rows],
            "steps": [r.step for r in rows],
        }
        out = []
        for name, _ in _ROW_FIELDS:
            host = staging[name][:n]
            host.numpy()[:] = columns[name]
            out.append(host.to(self.device, non_blocking=True))
        return out

    @staticmethod
    def _rows_to_process(rows: Sequence[SamplingRow]) -> list[int]:
        """The rows whose logits change before the draw (bias, penalties, min_tokens)."""
        return [
            i
            for i, r in enumerate(rows)
            if r.params.logit_bias or r.params.uses_penalties or r.step < r.params.min_tokens
        ]

    def _process(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow], needs: list[int]
    ) -> torch.Tensor:
        """float32 ``logits`` with ``needs``' rows processed (a copy if any are)."""
        if not needs:
            return logits
        logits = logits.clone()
        for i in needs:
            row, p = rows[i], rows[i].params
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias.keys()), device=self.device)
                bias = torch.tensor(list(p.logit_bias.values()), device=self.device)
                logits[i].index_add_(0, ids, bias.float())
            if row.step < p.min_tokens and row.stop_ids_until_min_tokens:
                logits[i, list(row.stop_ids_until_min_tokens)] = float("-inf")
            if p.uses_penalties:
                self._apply_penalties(logits[i], row)
        return logits

    def _apply_penalties(self, logits: torch.Tensor, row: SamplingRow) -> None:
        p = row.params
        out_ids = torch.tensor(row.output_token_ids, dtype=torch.long, device=self.device)
        counts = torch.zeros(self.vocab_size, device=self.device)
        counts.index_add_(0, out_ids, torch.ones_like(out_ids, dtype=torch.float32))
        if p.repetition_penalty != 1:
            seen = counts > 0
            prompt = torch.tensor(row.prompt_token_ids, dtype=torch.long, device=self.device)
            seen[prompt] = True
            penalised = torch.where(
                logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty
            )
            logits.copy_(torch.where(seen, penalised, logits))
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()


_ROW_FIELDS = (
    ("temperature", torch.float32),
    ("top_k", torch.int32),
    ("top_p", torch.float32),
    ("min_p", torch.float32),
    ("seeds", torch.int64),
    ("steps", torch.int64),
)


def _gather_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]
) -> list[TokenLogprobs | None]:
    """Logprobs of the model's own distribution (before penalties and temperature)."""
    logprobs = torch.log_softmax(logits, dim=-1)
    top_n = max(p.logprobs or 0 for p in params)
    chosen = logprobs.gather(1, tokens.view(-1, 1)).view(-1).tolist()
    top_vals, top_ids = logprobs.topk(top_n, dim=-1) if top_n else (None, None)
    token_list = tokens.tolist()
    result: list[TokenLogprobs | None] = []
    for i, p in enumerate(params):
        if p.logprobs is None:
            result.append(None)
            continue
        top = []
        if p.logprobs:
            top = list(zip(top_ids[i, : p.logprobs].tolist(), top_vals[i, : p.logprobs].tolist()))
        result.append(TokenLogprobs(token_list[i], chosen[i], top))
    return result
