"""Driving a `ModelPool` by hand, as the engine loop does, for the tests of several models."""

from __future__ import annotations

from ember.engine.model_pool import ModelPool, ModelState
from ember.sampling_params import SamplingParams


def submit(
    pool: ModelPool, names: list[str], prompts: list[list[int]], params: SamplingParams
) -> dict[str, list[int]]:
    """Queue every prompt on every model (ids ``NAME-i``); their tokens, to be filled."""
    got: dict[str, list[int]] = {}
    for name in names:
        for i, prompt in enumerate(prompts):
            pool.add_request(name, f"{name}-{i}", prompt, params)
            got[f"{name}-{i}"] = []
    return got


def drive(pool: ModelPool, got: dict[str, list[int]], loading: str) -> int:
    """Poll and step until every request is done and no transition is pending, collecting the
    tokens into ``got``; returns how many iterations had a loaded model with work while
    ``loading`` was still loading."""
    steps_while_loading = 0
    while pool.has_work() or pool.transitions_pending():
        pool.poll()
        if pool.state(loading) is ModelState.LOADING and pool.has_work():
            steps_while_loading += 1
        for update in pool.step():
            got[update.request_id].extend(update.new_token_ids)
    return steps_while_loading


def by_model(got: dict[str, list[int]], name: str, count: int) -> list[list[int]]:
    return [got[f"{name}-{i}"] for i in range(count)]
