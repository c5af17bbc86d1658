"""`ember bench head-split`: what overlapping attention with the q/k/v and o GEMMs would save.

A decode layer's attention is HBM-bound with its tensor cores idle, and the GEMMs around it are
tensor-bound at large batches, but each waits for the other. Cut the KV heads in two groups and
the chain loosens: group B's q/k/v GEMM can run beside group A's attention, and group A's share
of the o-projection (a split over its input columns) beside group B's attention. This measures
that on the Llama-3.1-8B attention block (q/k/v GEMM, decode attention, o GEMM) before any of it
goes into the model: per layer, in one CUDA graph over 32 layers that each read their own
weights and KV cache, the plain chain against the two-group schedule on two streams.

The q/k/v weight of the two-group schedule is stored per group, ``[q_A k_A v_A q_B k_B v_B]``,
so each group's GEMM reads one contiguous block of rows; a group's heads are views of its GEMM's
output with the strides the attention kernel takes as they are.

On an H200 the schedule lost 14-27 us a layer at batch 32-256 (bench/results/README.md, "Batch
256: the attention gap, the host, a head split, and norms past the skinny GEMM"): the kernels
did not run side by side. Kept to measure an attention kernel that leaves SMs to the GEMMs.
"""

from __future__ import annotations

import argparse
import json
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from ember.bench.kernel_bench import LLAMA_8B, AttentionShape, decode_inputs, sequence_seconds

HIDDEN_8B = 4096


@dataclass
class BlockWeights:
    """One layer's attention-block weights: q/k/v in plain order ``[q k v]``, the same rows per
    head group ``[q_A k_A v_A q_B k_B v_B]``, and o."""

    qkv: torch.Tensor
    qkv_grouped: torch.Tensor
    o: torch.Tensor


def group_qkv_rows(qkv: torch.Tensor, shape: AttentionShape, groups: int) -> torch.Tensor:
    """``qkv``'s rows reordered so each KV-head group's q, k and v rows are contiguous."""
    head, kv_heads = shape.head_dim, shape.num_kv_heads
    q_rows, kv_rows = shape.num_q_heads * head, kv_heads * head
    q, k, v = qkv.split([q_rows, kv_rows, kv_rows])
    parts = []
    for g in range(groups):
        parts += [q.chunk(groups)[g], k.chunk(groups)[g], v.chunk(groups)[g]]
    return torch.cat(parts)


def make_block_weights(shape: AttentionShape, hidden: int, groups: int, device, dtype):
    rows = (shape.num_q_heads + 2 * shape.num_kv_heads) * shape.head_dim
    qkv = torch.randn(rows, hidden, device=device, dtype=dtype) * hidden**-0.5
    o = torch.randn(hidden, shape.num_q_heads * shape.head_dim, device=device, dtype=dtype)
    return BlockWeights(qkv, group_qkv_rows(qkv, shape, groups), o * hidden**-0.5)


def _attend(q, k_cache, v_cache, meta, out, scale, max_seq_len, tiles=None):
    from ember.kernels.paged_attention import paged_attention

    paged_attention(q, k_cache, v_cache, meta["query_start_loc"], meta["seq_lens"],
                    meta["block_tables"], scale, out, max_query_len=1,
                    max_seq_len=max_seq_len, tile_config=tiles)  # fmt: skip


def plain_block(x, w: BlockWeights, k_cache, v_cache, meta, shape, max_seq_len, tiles=None):
    """q/k/v GEMM, attention over every head, o GEMM: one chain."""
    n, head = x.shape[0], shape.head_dim
    qkv = x @ w.qkv.T
    q = qkv[:, : shape.num_q_heads * head].view(n, shape.num_q_heads, head)
    out = torch.empty(n, shape.num_q_heads, head, device=x.device, dtype=x.dtype)
    _attend(q, k_cache, v_cache, meta, out, head**-0.5, max_seq_len, tiles)
    return out.view(n, -1) @ w.o.T


def attention_only(x, w: BlockWeights, k_cache, v_cache, meta, shape, max_seq_len, tiles=None):
    n, head = x.shape[0], shape.head_dim
    q = torch.empty(n, shape.num_q_heads, head, device=x.device, dtype=x.dtype)
    _attend(q, k_cache, v_cache, meta, torch.empty_like(q), head**-0.5, max_seq_len, tiles)


def gemms_only(x, w: BlockWeights, k_cache, v_cache, meta, shape, max_seq_len):
    attention_out = (x @ w.qkv.T)[:, : shape.num_q_heads * shape.head_dim]
    return attention_out @ w.o.T


class Streams:
    """The two-group schedule's streams: GEMMs on a high-priority stream (so their CTAs take
    SMs first as attention's retire), attention on a low-priority one (or both at the default priority)."""

    def __init__(self, prioritise_gemms: bool = True) -> None:
        low, high = torch.cuda.Stream.priority_range()
        self.gemm = torch.cuda.Stream(priority=high if prioritise_gemms else 0)
        self.attention = torch.cuda.Stream(priority=low if prioritise_gemms else 0)


def _after(stream, *events):
    for event in events:
        if stream is not None and event is not None:
            stream.wait_event(event)


def _record(stream):
    if stream is None:
        return None
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else nullcontext()


def grouped_block(x, w: BlockWeights, k_cache, v_cache, meta, shape, max_seq_len,
                  streams: Streams | None = None, groups: int = 2, tiles=None):  # fmt: skip
    """The same block over ``groups`` KV-head groups: group g's q/k/v GEMM, its attention on its
    heads' views, and its share of o (the o GEMM split over its input columns, accumulated).
    With ``streams`` the GEMMs and the attention run on two streams joined by events, so one
    group's GEMMs overlap another group's attention; None runs all in order on the current
    stream (the CPU)."""
    n, head, kv_heads = x.shape[0], shape.head_dim, shape.num_kv_heads
    group_kv, group_q = kv_heads // groups, shape.num_q_heads // groups
    rows_per_group = (group_q + 2 * group_kv) * head
    out = torch.empty(n, shape.num_q_heads, head, device=x.device, dtype=x.dtype)
    gemm_stream = streams.gemm if streams else None
    attention_stream = streams.attention if streams else None
    start = _record(torch.cuda.current_stream()) if streams else None
    _after(gemm_stream, start)
    _after(attention_stream, start)
    o = None
    attention_done, qkv_outputs = [], []
    for g in range(groups):
        with _on(gemm_stream):
            weight = w.qkv_grouped[g * rows_per_group : (g + 1) * rows_per_group]
            qkv = x @ weight.T
        # Held to the end: freed earlier, its memory could go to the GEMM stream's next output
        # while the attention stream still reads it.
        qkv_outputs.append(qkv)
        qkv_done = _record(gemm_stream)
        q, k_rows = qkv[:, : group_q * head], slice(g * group_kv, (g + 1) * group_kv)
        with _on(attention_stream):
            _after(attention_stream, qkv_done)
            # The new k/v columns are unused here: the cache already holds this step's keys.
            _attend(q.view(n, group_q, head), k_cache[:, :, k_rows], v_cache[:, :, k_rows], meta,
                    out[:, g * group_q : (g + 1) * group_q], head**-0.5, max_seq_len,
                    tiles)  # fmt: skip
        attention_done.append(_record(attention_stream))
    for g in range(groups):
        with _on(gemm_stream):
            _after(gemm_stream, attention_done[g])
            cols = slice(g * group_q * head, (g + 1) * group_q * head)
            part = out[:, g * group_q : (g + 1) * group_q].reshape(n, -1)
            o = part @ w.o[:, cols].T if o is None else torch.addmm(o, part, w.o[:, cols].T)
    if streams:
        torch.cuda.current_stream().wait_stream(gemm_stream)
        torch.cuda.current_stream().wait_stream(attention_stream)
    return o


def bench_point(batch: int, context: int, num_layers: int, shape: AttentionShape = LLAMA_8B,
                hidden: int = HIDDEN_8B) -> dict:  # fmt: skip
    dtype = torch.bfloat16
    layers = []
    for _ in range(num_layers):
        inputs = decode_inputs(shape, batch, context, dtype)
        meta = {k: inputs[k] for k in ("query_start_loc", "seq_lens", "block_tables")}
        weights = make_block_weights(shape, hidden, 2, "cuda", dtype)
        layers.append((weights, inputs["k_cache"], inputs["v_cache"], meta))
    x = torch.randn(batch, hidden, device="cuda", dtype=dtype)

    def run(block, **kwargs):
        def layer(i):
            weights, k_cache, v_cache, meta = layers[i]
            block(x, weights, k_cache, v_cache, meta, shape, context, **kwargs)

        return sequence_seconds(layer, num_layers) * 1e6

    plain = run(plain_block)
    row = {
        "batch": batch,
        "context": context,
        "plain_us_per_layer": plain,
        # The parts alone: what the overlap could hide at best is the smaller side's time.
        "attention_alone_us_per_layer": run(attention_only),
        "gemms_alone_us_per_layer": run(gemms_only),
    }
    for name, streams in (("two_groups_in_order", None),
                          ("two_groups_two_streams", Streams(prioritise_gemms=False)),
                          ("two_groups_gemms_first", Streams(prioritise_gemms=True))):  # fmt: skip
        row[f"{name}_us_per_layer"] = run(grouped_block, streams=streams)
        row[f"{name}_saves_us_per_layer"] = plain - row[f"{name}_us_per_layer"]
    # Attention's default decode programs are small enough to share an SM, so as one retires
    # another takes its place and a GEMM's large programs rarely find a free SM. Programs that
    # fill an SM's shared memory hand each freed SM to whichever stream dispatches first.
    wide = {"BLOCK_M": 16, "BLOCK_Q": 1, "BLOCK_N": 64, "num_warps": 4, "KV_STAGES": 6}
    row["one_program_per_sm_tiles"] = wide
    row["one_program_per_sm"] = {
        "plain_us_per_layer": run(plain_block, tiles=wide),
        "attention_alone_us_per_layer": run(attention_only, tiles=wide),
        "two_groups_gemms_first_us_per_layer": run(
            grouped_block, streams=Streams(prioritise_gemms=True), tiles=wide
        ),
    }
    layers.clear()
    torch.cuda.empty_cache()
    return row


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--output-json", type=Path, default=None)


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("ember bench head-split needs a CUDA GPU")
        return 2
    rows = []
    for context in args.contexts:
        for batch in args.batches:
            row = bench_point(batch, context, args.layers)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.output_json:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps({"gpu": torch.cuda.get_device_name(),
                                                "rows": rows}, indent=2))  # fmt: skip
    return 0
