"""Turns the logits of the rows that sample into token ids (and logprobs when asked).

Logit processing (logit bias, min_tokens, presence/frequency/repetition penalties) happens here
in PyTorch on the logits' device; the draw itself is `Ops.sample`, which follows the sampling
contract in docs/CONTRACTS.md, so a seeded request gets the same tokens whatever the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.engine.step_types import TokenLogprobs
from ember.layers.ops import Ops
from ember.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs to know about one sampling row."""

    params: SamplingParams
    seed: int
    step: int  # tokens this request has already generated
    token_ids: list[int]  # prompt then outputs; complete only when penalties are used
    num_prompt_tokens: int
    stop_ids_until_min_tokens: tuple[int, ...]  # EOS and stop ids, masked before min_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


class Sampler:
    def __init__(self, ops: Ops, vocab_size: int, device: torch.device) -> None:
        self.ops = ops
        self.vocab_size = vocab_size
        self.device = device

    def __call__(
        self, logits: torch.Tensor, rows: list[SamplingRow]
    ) -> tuple[torch.Tensor, list[TokenLogprobs | None] | None]:
        raw_logits = logits
        logits = self._process(logits, rows)
        params = [r.params for r in rows]
        if all(p.greedy for p in params):
            tokens = logits.argmax(dim=-1)  # the common benchmark case: one cheap reduction
            return tokens, _gather_logprobs(raw_logits, tokens, params) if any(
                p.logprobs is not None for p in params
            ) else None
        as_tensor = _row_tensor_builder(self.device)
        tokens = self.ops.sample(
            logits,
            as_tensor([p.temperature for p in params], torch.float32),
            as_tensor([p.top_k for p in params], torch.int32),
            as_tensor([p.top_p for p in params], torch.float32),
            as_tensor([p.min_p for p in params], torch.float32),
            as_tensor([r.seed for r in rows], torch.int64),
            as_tensor([r.step for r in rows], torch.int64),
        )
        logprobs = None
        if any(p.logprobs is not None for p in params):
            logprobs = _gather_logprobs(raw_logits, tokens, params)
        return tokens, logprobs

    def _process(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        needs = [
            i
            for i, r in enumerate(rows)
            if r.params.logit_bias or r.params.uses_penalties or r.step < r.params.min_tokens
        ]
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


def _row_tensor_builder(device: torch.device):
    def build(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    return build


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
