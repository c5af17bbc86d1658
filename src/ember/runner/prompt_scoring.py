"""Prompt logprobs: each prompt token's logprob given the tokens before it, and its top
alternatives, for the requests that ask (`SamplingParams.prompt_logprobs`).

They come from the logits of the prompt positions as the prompt is fed, chunk by chunk: the
row at position p scores prompt token p + 1 (the last prompt position's row samples the first
output token instead). The runner keeps a `PromptScoring` per such request until the step of
its first sample is launched; a step's `StepScores` are recorded into the request when the step
is collected (`Request.prompt_logprobs`), or dropped with its sample when the request ended or
was preempted meanwhile, so a recomputation scores each position exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ember.engine.step_types import SchedulerOutput, TokenLogprobs

if TYPE_CHECKING:
    from ember.runner.model_runner import RunningRequest


@dataclass(eq=False)
class PromptScoring:
    """A request whose prompt is still being scored: the next position whose row scores."""

    state: RunningRequest
    next_position: int


@dataclass(eq=False)
class StepScores:
    """The prompt rows one step scores. ``segments``: per request, in row order, its state,
    how many rows and how many alternatives it wants; ``completing``: the requests whose
    prompt is scored once this step's sample is in. After `compute`, ``results`` holds the
    chosen logprobs [R], their ranks [R], and the top values and ids [R, k] (on the host, or
    being copied there, on a GPU)."""

    rows: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    segments: list[tuple[RunningRequest, int, int]] = field(default_factory=list)
    completing: list[RunningRequest] = field(default_factory=list)
    results: tuple[torch.Tensor, ...] | None = None

    def compute(self, model: torch.nn.Module, hidden: torch.Tensor, max_rows: int) -> None:
        """Score the rows of ``hidden`` (the step's final hidden states), ``max_rows`` at a
        time: the row counts a step's logits projection is warmed at, and a bound on the
        float32 [rows, vocab] it holds."""
        if not self.rows:
            return
        device = hidden.device
        rows, targets = _to_device(self.rows, device), _to_device(self.targets, device)
        top_k = max(k for _, _, k in self.segments)
        parts = []
        for index in row_chunks(len(self.rows), max_rows):
            logits = model.compute_logits(hidden.index_select(0, rows[index]))
            parts.append(_score(logits.float(), targets[index], top_k))
        results = [torch.cat(columns) for columns in zip(*parts)]
        if device.type == "cuda":  # copied out before the step's done event is recorded
            results = [_pinned_copy(t) for t in results]
        self.results = tuple(results)

    def entries(self) -> list[list[TokenLogprobs]]:
        """Per segment, its rows as `TokenLogprobs` (once the step is done)."""
        chosen, ranks, top_values, top_ids = (t.tolist() for t in self.results)
        out, row = [], 0
        for _, count, k in self.segments:
            out.append(
                [
                    TokenLogprobs(
                        self.targets[i],
                        chosen[i],
                        list(zip(top_ids[i][:k], top_values[i][:k])),
                        ranks[i],
                    )
                    for i in range(row, row + count)
                ]
            )
            row += count
        return out


def row_chunks(count: int, max_rows: int) -> list[slice]:
    """The chunks of ``count`` scored rows whose logits are computed at once, in order: every
    tensor-parallel rank computes the same (`ember.parallel.shard_step`)."""
    return [slice(start, start + max_rows) for start in range(0, count, max_rows)]


def plan_scores(
    scoring: dict[str, PromptScoring],
    scheduled: SchedulerOutput,
    token_ends: list[int],
    seq_ends: list[int],
) -> StepScores | None:
    """The rows this step scores for the requests in ``scoring`` (``token_ends``,
    ``seq_ends``: per scheduled sequence, its last row + 1 and its KV length after the step).
    Advances each request's next position; a request whose prompt ends in this step leaves
    ``scoring`` for the step's ``completing``. None when the step scores nothing."""
    counts = scheduled.num_scheduled_tokens
    index = {request_id: s for s, request_id in enumerate(counts)}
    scores = StepScores()
    for request_id, entry in list(scoring.items()):
        s = index.get(request_id)
        if s is None:
            continue
        state, n = entry.state, counts[request_id]
        request = state.request
        prompt, end = request.prompt_token_ids, seq_ends[s]
        start, row0 = end - n, token_ends[s] - n
        first, last = max(start, entry.next_position), min(end, len(prompt) - 1)
        if last > first:
            scores.rows.extend(range(row0 + first - start, row0 + last - start))
            scores.targets.extend(prompt[first + 1 : last + 1])
            scores.segments.append((state, last - first, request.params.prompt_logprobs))
            entry.next_position = last
        if end >= len(prompt):
            scores.completing.append(state)
            del scoring[request_id]
    return scores if scores.segments or scores.completing else None


def _score(logits: torch.Tensor, targets: torch.Tensor, top_k: int) -> tuple:
    """float32 ``logits`` [R, V] -> the targets' logprobs, their ranks (1: the most likely),
    and the top values and ids."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, targets.view(-1, 1)).view(-1)
    ranks = (logprobs > chosen.view(-1, 1)).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(top_k, dim=-1)
    return chosen, ranks, top_values, top_ids


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=torch.long)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
