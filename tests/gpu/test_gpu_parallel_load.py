"""Weights read through pinned buffers onto several CUDA streams (`ember.weights.parallel_load`):
bit-exact with the `safetensors` library, casts done on the GPU, and a model loaded that way
while its kernels compile gives the tokens of one loaded with no compile pass. Skipped without
a CUDA GPU."""

from __future__ import annotations

import pytest
import torch
from helpers.tiny_models import make_tiny_model
from safetensors.torch import save_file

from ember import LLM, SamplingParams
from ember.weights.parallel_load import load_extents
from ember.weights.safetensors_layout import read_extents

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("target_dtype", [None, torch.bfloat16])
def test_pinned_multi_stream_load_is_bit_exact(tmp_path, target_dtype):
    generator = torch.Generator().manual_seed(3)
    tensors = {f"t{i}": torch.randn(257, 129 + i, generator=generator) for i in range(12)}
    tensors["ids"] = torch.arange(1000)
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    device = torch.device("cuda")
    targets = {}
    for name, tensor in tensors.items():
        dtype = target_dtype if tensor.is_floating_point() and target_dtype else tensor.dtype
        targets[name] = torch.full(tensor.shape, 7, dtype=dtype, device=device)
    # Small chunks and few buffers: every buffer is reused many times across the streams.
    load_extents(
        read_extents(path),
        lambda e: targets[e.name],
        device,
        read_threads=3,
        copy_streams=3,
        chunk_bytes=4096,
    )
    for name, tensor in tensors.items():
        assert torch.equal(targets[name].cpu(), tensor.to(targets[name].dtype)), name


def test_loading_while_compiling_gives_the_tokens_of_a_load_without_compiling(tmp_path):
    path = make_tiny_model("LlamaForCausalLM", tmp_path / "m", max_shard_size="300KB")
    prompts = [{"prompt_token_ids": [5, 9, 14, 3, 77, 21, 8]}, {"prompt_token_ids": [40] * 19}]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    kwargs = {
        "device": "cuda",
        "max_model_len": 128,
        "max_num_seqs": 8,
        "dtype": "float32",
        "kv_cache_memory_bytes": 64 << 20,
    }
    overlapped = LLM(str(path), compile_workers=4, **kwargs)
    assert overlapped.instance.load_report.weight_load_seconds > 0
    ours = [o.outputs[0].token_ids for o in overlapped.generate(prompts, params)]
    del overlapped
    sequential = LLM(str(path), compile_workers=0, enforce_eager=True, **kwargs)
    theirs = [o.outputs[0].token_ids for o in sequential.generate(prompts, params)]
    assert ours == theirs
