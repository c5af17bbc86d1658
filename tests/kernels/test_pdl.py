"""Programmatic dependent launch: the wiring (CPU) and, on a Hopper GPU, that a decoder-shaped
chain of PDL kernels in a CUDA graph gives bit for bit what the plain launches give.

PDL changes when a kernel starts, never what it computes: any difference is a kernel that read or
wrote before waiting for the one before it (a race).
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from functools import partial

import pytest
import torch

from ember.cli import add_fast_path_arguments, engine_options
from ember.config import StepLimits, engine_config
from ember.kernels.linear import LinearRouter
from ember.kernels.pdl import supports_programmatic_launch
from ember.kernels.skinny_gemm import skinny_gemm, skinny_gemm_silu
from ember.kernels.tuning import KernelTuning, LinearRoutes
from ember.layers.attention import select_attention
from ember.layers.forward_context import ForwardContext
from ember.layers.ops import Ops, _launch_by_rows, reference_ops, select_ops, triton_ops
from ember.layers.reference_ops import build_cos_sin_cache

EPS = 1e-5
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 256, 4, 2, 64, 384
PAGE, CONTEXTS = 16, (37, 100, 260)


def test_ops_pass_pdl_to_the_step_kernels_only():
    ops = triton_ops(programmatic_launch="on")
    assert ops.programmatic_launch == "on" and ops.launches_with_pdl(512)
    for op in (
        ops.linear,
        ops.rms_norm,
        ops.fused_add_rms_norm,
        ops.silu_and_mul,
        ops.gate_up_silu,
    ):
        assert op.keywords == {"pdl": True}
    assert not hasattr(ops.sample, "keywords")  # the sampler follows plain torch ops
    plain = triton_ops()
    assert plain.programmatic_launch == "off" and not plain.launches_with_pdl(1)
    assert not hasattr(plain.linear, "keywords")
    with pytest.raises(ValueError, match="programmatic_launch must be one of"):
        triton_ops(programmatic_launch="sometimes")


def test_auto_launches_with_pdl_at_the_tunings_step_sizes():
    """Under "auto" a step launches with PDL where its device's table says so, and two tables
    route the same step differently."""
    seen = []

    def op(x, *args, pdl=False, **kwargs):
        seen.append((x.shape[0], args, kwargs, pdl))
        return x

    rows = frozenset({2, 17})
    auto = partial(_launch_by_rows, op, rows)
    for n in (1, 2, 17, 64):
        auto(torch.zeros(n, 3), "w", row_norm=None)
    assert seen == [(n, ("w",), {"row_norm": None}, n in rows) for n in (1, 2, 17, 64)]
    tuned = triton_ops(programmatic_launch="auto", tuning=KernelTuning(pdl_rows=rows))
    other = triton_ops(programmatic_launch="auto", tuning=KernelTuning(pdl_rows=frozenset({1})))
    assert tuned.linear.func is _launch_by_rows and tuned.linear.args[1] == rows
    assert tuned.launches_with_pdl(17) and not other.launches_with_pdl(17)
    assert other.launches_with_pdl(1) and not tuned.launches_with_pdl(1)
    off = triton_ops(programmatic_launch="off", tuning=KernelTuning(pdl_rows=rows))
    assert not off.launches_with_pdl(2)


def test_select_ops_launches_plainly_unless_asked_and_checks_support():
    cpu = torch.device("cpu")
    assert not supports_programmatic_launch(cpu)
    assert select_ops(cpu, "triton").programmatic_launch == "off"
    assert select_ops(cpu, "triton", programmatic_launch="auto").programmatic_launch == "off"
    with pytest.raises(ValueError, match="compute capability"):
        select_ops(cpu, "triton", programmatic_launch="on")


def test_pdl_routes_every_decode_product_to_the_chainable_kernel():
    """A cuBLAS kernel would break the chain, so q/k/v and gate/up move too, up to the skinny
    kernel's rows."""
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    routes = LinearRoutes()
    router = LinearRouter(routes)
    rows = routes.skinny_qkv_max_rows + 1
    assert not router.takes_skinny(rows, 6144, 4096, bf16, cuda)  # qkv: cuBLAS without PDL
    assert router.takes_skinny(rows, 6144, 4096, bf16, cuda, pdl=True)
    assert router.takes_skinny(routes.skinny_max_rows, 28672, 4096, bf16, cuda, pdl=True)
    assert not router.takes_skinny(routes.skinny_max_rows + 1, 6144, 4096, bf16, cuda, pdl=True)
    assert not router.takes_skinny(1, 6144, 4096, torch.float32, cuda, pdl=True)


def test_cli_flag_is_auto_by_default_and_on_when_bare():
    parser = argparse.ArgumentParser()
    add_fast_path_arguments(parser)

    def mode(*argv):
        return engine_config(**engine_options(parser.parse_args(list(argv)))).programmatic_launch

    assert mode() == "auto"
    assert mode("--programmatic-launch") == "on"
    assert mode("--programmatic-launch", "off") == "off"
    with pytest.raises(SystemExit):
        parser.parse_args(["--programmatic-launch", "always"])


def test_fast_path_flags_reach_the_engine_config_and_default_to_its_defaults():
    parser = argparse.ArgumentParser()
    add_fast_path_arguments(parser)
    args = parser.parse_args(
        ["--separate-decode-rope", "--programmatic-launch", "--separate-norms"]
    )
    config = engine_config("m", **engine_options(args))
    assert config.decode_rope_in_attention is False and config.programmatic_launch == "on"
    assert config.defer_norms is False
    assert engine_config("m", **engine_options(parser.parse_args([]))) == engine_config("m")
    assert engine_config("m").fp8_widen_in_registers
    off = engine_options(parser.parse_args(["--no-fp8-widen-in-registers"]))
    assert engine_config("m", **off).fp8_widen_in_registers is False


class DecoderChain:
    """Two Llama-shaped decoder layers at decode through an `Ops` and its attention backend:
    norm, q/k/v, RoPE + cache write + split-KV attention (3 sequences, 2 KV heads: the
    heuristic splits; partials merged in the kernel), o, add + norm, gate/up, SiLU, down."""

    def __init__(
        self, device: torch.device, gen: torch.Generator, dtype: torch.dtype, layers: int = 2
    ) -> None:
        batch = len(CONTEXTS)

        def rand(*shape, scale=1.0):
            return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

        self.weights = [
            {
                "qkv": rand((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN, scale=HIDDEN**-0.5),
                "o": rand(HIDDEN, HEADS * HEAD_DIM, scale=(HEADS * HEAD_DIM) ** -0.5),
                "gate_up": rand(2 * INTER, HIDDEN, scale=HIDDEN**-0.5),
                "down": rand(HIDDEN, INTER, scale=INTER**-0.5),
                "norm1": rand(HIDDEN, scale=0.1) + 1,
                "norm2": rand(HIDDEN, scale=0.1) + 1,
            }
            for _ in range(layers)
        ]
        blocks = [-(-n // PAGE) for n in CONTEXTS]
        table = torch.zeros(batch, max(blocks), dtype=torch.int32)
        start = 1
        for seq, n in enumerate(blocks):
            table[seq, :n] = torch.arange(start, start + n)
            start += n
        cache_shape = (layers, start, PAGE, KV_HEADS, HEAD_DIM)
        positions = torch.tensor(CONTEXTS) - 1
        slots = table[torch.arange(batch), positions // PAGE].long() * PAGE + positions % PAGE
        self.state = {
            "x": rand(batch, HIDDEN),
            "residual": rand(batch, HIDDEN),
            "k_cache": rand(*cache_shape),
            "v_cache": rand(*cache_shape),
        }
        self.dtype, self.device = dtype, device
        self.cos_sin = build_cos_sin_cache(HEAD_DIM, 512, 10000.0, None).to(device)
        self.ctx = ForwardContext(
            positions=positions.to(device),
            slot_mapping=slots.to(device),
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(CONTEXTS, dtype=torch.int32, device=device),
            block_tables=table.to(device),
            max_query_len=1,
            max_seq_len=max(CONTEXTS),
        )

    def fresh_state(self) -> dict[str, torch.Tensor]:
        return {name: t.clone() for name, t in self.state.items()}

    def run(self, s: dict[str, torch.Tensor], ops: Ops) -> None:
        """One step in place on ``s``; the result is ``s['x']``, ``s['residual']`` and caches."""
        x, residual = s["x"], s["residual"]
        batch = x.shape[0]
        limits = StepLimits(max_num_seqs=batch)
        attention = select_attention(
            ops, HEADS, KV_HEADS, HEAD_DIM, self.dtype, self.device, limits
        )
        for i, w in enumerate(self.weights):
            ops.fused_add_rms_norm(x, residual, w["norm1"], EPS)
            qkv = ops.linear(x, w["qkv"])
            q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
            q = q.view(batch, HEADS, HEAD_DIM)
            k, v = (t.view(batch, KV_HEADS, HEAD_DIM) for t in (k, v))
            attn = torch.empty_like(q)
            attention.forward(
                q,
                k,
                v,
                self.ctx,
                self.cos_sin,
                s["k_cache"][i],
                s["v_cache"][i],
                HEAD_DIM**-0.5,
                attn,
            )
            out = ops.linear(attn.view(batch, -1), w["o"])
            ops.fused_add_rms_norm(out, residual, w["norm2"], EPS)
            x = ops.linear(ops.gate_up_silu(out, w["gate_up"]), w["down"])
        s["x"].copy_(x)


def test_decoder_chain_on_the_kernels_matches_the_reference(gen, device):
    """The chain below, checked once against the reference ops so that its GPU comparison of
    launch modes compares right answers."""
    chain = DecoderChain(device, gen, torch.float32)
    got, expected = chain.fresh_state(), chain.fresh_state()
    chain.run(got, triton_ops())
    chain.run(expected, reference_ops())
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(
    not torch.cuda.is_available() or not supports_programmatic_launch(torch.device("cuda")),
    reason="programmatic dependent launch needs a Hopper or later GPU",
)
def test_pdl_chain_in_a_cuda_graph_is_bitwise_the_plain_chain(gen):
    device = torch.device("cuda")
    chain = DecoderChain(device, gen, torch.bfloat16)
    # The same kernels both ways (every product on the skinny GEMM), launched plainly or with PDL.
    plain_ops = replace(triton_ops(), linear=skinny_gemm, gate_up_silu=skinny_gemm_silu)
    pdl_ops = replace(
        triton_ops(programmatic_launch="on"),
        linear=partial(skinny_gemm, pdl=True),
        gate_up_silu=partial(skinny_gemm_silu, pdl=True),
    )
    plain = chain.fresh_state()
    chain.run(plain, plain_ops)

    eager = chain.fresh_state()
    chain.run(eager, pdl_ops)  # also compiles the PDL variants outside the capture
    graphed = chain.fresh_state()
    inputs = {name: t.clone() for name, t in graphed.items()}
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain.run(graphed, pdl_ops)
    for replay in range(3):
        for name, t in graphed.items():
            t.copy_(inputs[name])
        graph.replay()
        torch.cuda.synchronize()
        for name in plain:
            assert torch.equal(eager[name], plain[name]), name
            assert torch.equal(graphed[name], plain[name]), (name, replay)
