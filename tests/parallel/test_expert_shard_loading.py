"""Each tensor-parallel rank of a mixture of experts reads its rows of every expert and nothing
more: its stacked experts are the single-GPU model's, cut along the intermediate rows (gate's
and the matching up's, down's matching columns: of FP8 weights with their row scales, of
packed MXFP4 blocks with their group scales), in every checkpoint layout the families have;
over the ranks each expert byte is read once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.fp8_checkpoints import fp8_checkpoint
from helpers.mxfp4_checkpoints import mxfp4_checkpoint
from helpers.shard_loads import checkpoint_tensors, load_rank
from helpers.tiny_models import make_tiny_model

pytestmark = pytest.mark.slow

# An expert block's parameters that a rank holds a share of: the dimension of their
# intermediate rows, and whether gate's and up's are stacked along it (gate first).
_SHARES = {
    "w13": (1, True),
    "w13_scale": (1, True),
    "w13_blocks": (1, True),
    "w13_scales": (1, True),
    "b13": (1, True),
    "w2": (2, False),
    "w2_blocks": (2, False),
    "w2_scales": (2, False),
    "shared_expert.gate_up_proj.weight": (0, True),
    "shared_expert.down_proj.weight": (1, False),
}


def per_expert_fp8(root: Path) -> Path:
    """Qwen3-MoE with one tensor per expert in FP8, per-row scales (llm-compressor's)."""
    source = make_tiny_model("Qwen3MoeForCausalLM", root / "float", num_hidden_layers=1)
    return fp8_checkpoint(source, root / "fp8", "compressed-tensors")


BUILDERS = {
    "qwen3-moe-per-expert-fp8": per_expert_fp8,
    "qwen3-moe-stacked": lambda root: make_tiny_model(
        "Qwen3MoeForCausalLM", root / "m", stacked_experts=True, num_hidden_layers=1
    ),
    "gpt-oss-interleaved": lambda root: make_tiny_model(
        "GptOssForCausalLM", root / "m", num_hidden_layers=1
    ),
    "gpt-oss-mxfp4": lambda root: mxfp4_checkpoint(
        make_tiny_model("GptOssForCausalLM", root / "float", num_hidden_layers=1), root / "m"
    ),
    "llama4-transposed": lambda root: make_tiny_model("Llama4ForCausalLM", root / "m"),
}


@pytest.fixture(scope="module", params=list(BUILDERS), ids=list(BUILDERS))
def checkpoint(request, tmp_path_factory) -> Path:
    return BUILDERS[request.param](tmp_path_factory.mktemp(request.param))


def rank_share(whole: torch.Tensor, name: str, rank: int, size: int) -> torch.Tensor:
    """What rank ``rank`` of ``size`` holds of the single-GPU model's expert block parameter
    ``name``: the router and down's row scales whole."""
    if name not in _SHARES:
        return whole
    dim, gate_and_up = _SHARES[name]
    parts = whole.chunk(2, dim=dim) if gate_and_up else (whole,)
    return torch.cat([part.chunk(size, dim=dim)[rank] for part in parts], dim=dim)


def comparable(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor


def expert_blocks(model) -> dict[int, torch.nn.Module]:
    return {i: layer.mlp for i, layer in enumerate(model.layers) if hasattr(layer.mlp, "gate")}


@pytest.mark.parametrize("size", [2, 4])
def test_a_rank_holds_its_rows_of_every_expert(checkpoint, size):
    whole_model, _ = load_rank(checkpoint, 0, 1)
    whole = expert_blocks(whole_model)
    assert whole, "a model with experts"
    for rank in range(size):
        model, _ = load_rank(checkpoint, rank, size)
        for index, block in expert_blocks(model).items():
            expected = dict(whole[index].named_parameters())
            got = dict(block.named_parameters())
            if "b2" in expected:  # added once over the ranks: rank 0 holds it
                assert ("b2" in got) == (rank == 0)
                expected.pop("b2")
                got.pop("b2", None)
            assert got.keys() == expected.keys()
            for name, param in got.items():
                share = rank_share(expected[name], name, rank, size)
                assert torch.equal(comparable(param), comparable(share)), (index, name)


def test_the_ranks_read_each_expert_byte_once(checkpoint):
    """Summed over the ranks, the reads are the file's tensor bytes plus, for each rank past
    the first, those every rank holds whole (norms, routers, down's row scales, o's bias), and
    the k/v rows of a KV head two ranks share (2 of 4 ranks). An expert's down bias is read
    by rank 0 alone."""
    whole = checkpoint_tensors(checkpoint)
    nbytes = lambda t: t.numel() * t.element_size()
    total = sum(nbytes(t) for t in whole.values())
    whole_on_every_rank = (
        "norm.",
        ".gate.weight",
        ".router.",
        "o_proj.bias",
        "o_proj.weight_scale",
        "down_proj.weight_scale",
    )
    replicated = sum(
        nbytes(t) for name, t in whole.items() if any(w in name for w in whole_on_every_rank)
    )
    kv = sum(nbytes(t) for name, t in whole.items() if ".k_proj." in name or ".v_proj." in name)
    for size, kv_copies in ((2, 1), (4, 2)):
        reads = [load_rank(checkpoint, rank, size)[1] for rank in range(size)]
        assert sum(reads) == total + (size - 1) * replicated + (kv_copies - 1) * kv
