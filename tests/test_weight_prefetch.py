"""Which weights a decode step asks to pull into L2, and when (the policy, on the CPU: the
prefetcher records its launches instead of forking a stream)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from helpers.tiny_models import make_tiny_model

from ember import LLM, SamplingParams
from ember.layers.weight_prefetch import WeightPrefetcher

GAP = 4096


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("llama"))
    return LLM(str(path), device="cpu", dtype="float32", max_model_len=128)


def run_with_prefetcher(llm, mode, max_tokens, prompts, new_tokens):
    """Generate with a recording prefetcher on every module; returns the (weight name, byte cap)
    of each launch, step by step, and the generated tokens."""
    model = llm.instance.model
    names = {id(p): name for name, p in model.named_parameters()}
    calls = []
    prefetcher = WeightPrefetcher(
        mode, max_tokens, GAP, launch=lambda w, cap: calls.append((names[id(w)], cap))
    )
    original = model.ops
    ops = replace(original, weight_prefetcher=prefetcher)
    try:
        for module in model.modules():
            if getattr(module, "ops", None) is original:
                module.ops = ops
        params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        for module in model.modules():
            if getattr(module, "ops", None) is ops:
                module.ops = original
    return calls, [o.outputs[0].token_ids for o in outs]


def decode_step_calls(num_layers: int, mode: str) -> list[tuple[str, int | None]]:
    """What one small decode step should launch, in order."""
    calls = []
    for i in range(num_layers):
        layer = f"layers.{i}"
        calls.append((f"{layer}.self_attn.o_proj.weight", None))
        if mode == "all":
            after = f"layers.{i + 1}.self_attn.qkv_proj.weight" if i + 1 < num_layers else "lm_head"
            calls += [
                (f"{layer}.mlp.gate_up_proj.weight", GAP),
                (f"{layer}.mlp.down_proj.weight", GAP),
                (after, GAP),
            ]
    return calls


@pytest.mark.parametrize("mode", ["attention", "all"])
def test_each_small_decode_step_prefetches_the_next_weights_in_order(llm, mode):
    layers = llm.instance.model_config.num_layers
    new_tokens = 4
    calls, _ = run_with_prefetcher(llm, mode, 1, [[5, 6, 7, 8, 9]], new_tokens)
    # The 5-token prefill is over the 1-token limit; each of the 3 decode steps prefetches.
    assert calls == decode_step_calls(layers, mode) * (new_tokens - 1)


def test_no_prefetch_past_the_batch_limit_or_when_off(llm):
    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    calls, _ = run_with_prefetcher(llm, "all", 1, prompts, 3)
    assert calls == []  # every step has two sequences
    calls, _ = run_with_prefetcher(llm, "off", 64, prompts, 3)
    assert calls == []
    calls, _ = run_with_prefetcher(llm, "attention", 2, prompts, 3)
    layers = llm.instance.model_config.num_layers
    assert calls == decode_step_calls(layers, "attention") * 2


def test_rejects_an_unknown_mode():
    with pytest.raises(ValueError, match="L2 prefetch mode"):
        WeightPrefetcher("everything", 8)


def test_cli_switches_reach_the_engine_config():
    import argparse

    from ember.cli import add_fast_path_arguments, fast_path_options
    from ember.config import EngineConfig

    parser = argparse.ArgumentParser()
    add_fast_path_arguments(parser)
    args = ["--l2-prefetch", "all", "--l2-prefetch-max-batch", "4", "--separate-decode-rope"]
    config = EngineConfig(model="m", **fast_path_options(parser.parse_args(args)))
    assert (config.l2_prefetch, config.l2_prefetch_max_batch) == ("all", 4)
    assert config.decode_rope_in_attention is False
    defaults = EngineConfig(model="m", **fast_path_options(parser.parse_args([])))
    assert defaults == EngineConfig(model="m")
    with pytest.raises(SystemExit):
        parser.parse_args(["--l2-prefetch", "some"])


def test_prefetch_before_hopper_is_an_error():
    import torch

    from ember.layers.ops import select_ops

    with pytest.raises(ValueError, match="compute capability 9"):
        select_ops(torch.device("cpu"), "triton", l2_prefetch="attention")
    assert select_ops(torch.device("cpu"), "triton").weight_prefetcher is None
