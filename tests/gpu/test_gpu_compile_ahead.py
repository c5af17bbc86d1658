"""Kernels compiled ahead (`ember.kernels.compile_ahead`) on a GPU: the compile-only launch makes
the same specialisation a real launch needs, runs nothing, and the real launch then compiles
nothing more. Skipped without a CUDA GPU."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl
from helpers.tiny_models import make_tiny_model

from ember import LLM, SamplingParams
from ember.kernels.compile_ahead import compile_ahead, launch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, factor, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) * factor, mask=mask)


@pytest.fixture
def compiles(monkeypatch):
    """Every compile Triton finishes in this test (its post-compile hook's calls)."""
    seen = []

    def hook(*args, **kwargs):
        seen.append(kwargs.get("fn") or args)
        return False

    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", hook)
    return seen


def test_compiled_ahead_then_launched_without_another_compile(compiles):
    x = torch.randn(1000, device="cuda")
    out = torch.zeros_like(x)
    factor = 2.5
    grid = (triton.cdiv(x.numel(), 256),)
    with compile_ahead(2):
        launch(_scale_kernel, grid, x, out, x.numel(), factor, BLOCK=256)
        launch(_scale_kernel, grid, x, out, x.numel(), factor, BLOCK=256)  # queued once
    torch.cuda.synchronize()
    assert len(compiles) == 1
    assert torch.count_nonzero(out) == 0  # compiled, not run
    launch(_scale_kernel, grid, x, out, x.numel(), factor, BLOCK=256)
    torch.testing.assert_close(out, x * factor)
    assert len(compiles) == 1  # the launch found it compiled


def test_engine_compiles_its_kernels_before_the_first_request(tmp_path, compiles):
    """Loaded with a compile pass, serving compiles nothing (graphs, a mixed step's logits and
    the sampler at any row count were all compiled at start-up), and the tokens match an
    instance loaded without the pass."""
    path = make_tiny_model("LlamaForCausalLM", tmp_path / "m")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 40, 90)]
    options = {"max_model_len": 256, "max_num_seqs": 8, "max_num_batched_tokens": 128}
    ahead = LLM(str(path), compile_workers=4, **options)
    report = ahead.instance.load_report
    assert report.compile_workers == 4 and report.kernel_compile_seconds > 0
    assert report.graphs_captured > 0
    compiles.clear()
    tokens = [o.outputs[0].token_ids for o in ahead.generate(prompts, params)]
    drawn = ahead.generate(
        prompts, SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=8)
    )
    assert all(o.outputs[0].token_ids for o in drawn)
    assert compiles == []
    del ahead
    plain = LLM(str(path), compile_workers=0, **options)
    assert plain.instance.load_report.compile_workers == 0
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, params)] == tokens
