"""Decode attention alone on the GPU, judged against the HBM roofline.

A decode step's attention must read every sequence's K and V once; its floor is
``bytes moved / HBM bandwidth``. ``bench_attention`` times ``ember.kernels.paged_attention`` on
decode-only steps of the Llama-3.1-8B attention shape and reports the fraction of that floor it
reaches. The headline time replays the kernel from a CUDA graph with L2 flushed before each call
(how the engine runs decodes); ``triton.testing.do_bench``'s median, which includes the Python
launch overhead, is reported next to it as ``eager_us``. When the split-KV heuristic splits,
the unsplit kernel is timed too, so a bad split shows up.

Import-safe without a GPU: torch and Triton's GPU parts are touched only when a function runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DECODE_CONTEXTS = (512, 4096)


@dataclass(frozen=True)
class AttentionShape:
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int


LLAMA_8B = AttentionShape(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)


def decode_attention_bytes(shape: AttentionShape, batch: int, context: int, elem: int) -> int:
    """Bytes a decode step's attention must move: K and V of every cached token, q in, out out,
    and the block tables."""
    kv = 2 * batch * context * shape.num_kv_heads * shape.head_dim * elem
    q_and_out = 2 * batch * shape.num_q_heads * shape.head_dim * elem
    tables = batch * -(-context // shape.block_size) * 4
    return kv + q_and_out + tables


def decode_inputs(
    shape: AttentionShape, batch: int, context: int, dtype: torch.dtype, device: str = "cuda"
):
    """A decode step over a shuffled block pool (block 0 left unused, as in the engine)."""
    blocks_per_seq = -(-context // shape.block_size)
    num_blocks = 1 + batch * blocks_per_seq
    cache_shape = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
    k_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    v_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    ids = torch.randperm(num_blocks - 1, device=device, dtype=torch.int32) + 1
    return {
        "q": torch.randn(batch, shape.num_q_heads, shape.head_dim, dtype=dtype, device=device),
        "k_cache": k_cache,
        "v_cache": v_cache,
        "query_start_loc": torch.arange(batch + 1, dtype=torch.int32, device=device),
        "seq_lens": torch.full((batch,), context, dtype=torch.int32, device=device),
        "block_tables": ids.view(batch, blocks_per_seq),
    }


def _warm_up(fn) -> None:
    """Run ``fn`` once on a side stream (compiles kernels) before a capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)


def _median_replay_seconds(graph: torch.cuda.CUDAGraph, replays: int = 5) -> float:
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return sorted(times)[len(times) // 2]


def gpu_seconds(fn, *, iters: int = 20, flush_bytes: int = 256 << 20) -> float:
    """GPU time of ``fn`` as the engine runs it: replayed from a CUDA graph (no launch or Python
    overhead), with L2 flushed before each call; the flush's own time is subtracted."""
    flush = torch.empty(flush_bytes, dtype=torch.int8, device="cuda")
    _warm_up(fn)

    def capture(with_fn: bool) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                flush.zero_()
                if with_fn:
                    fn()
        return graph

    with_fn, flush_only = capture(True), capture(False)
    elapsed = _median_replay_seconds(with_fn) - _median_replay_seconds(flush_only)
    return max(0.0, elapsed) / iters


def sequence_seconds(layer_fn, num_layers: int) -> float:
    """GPU time per layer of ``layer_fn(0) ... layer_fn(num_layers - 1)`` replayed from one CUDA
    graph, as a decode step runs its layers: each layer's kernels meet their real neighbours and
    each reads its own weights (so nothing stays in L2 across layers), with no flush between.
    `gpu_seconds`' flushed, one-kernel timing ranked the skinny GEMM level with cuBLAS where
    the engine's step showed it slower."""

    def all_layers() -> None:
        for layer in range(num_layers):
            layer_fn(layer)

    _warm_up(all_layers)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        all_layers()
    graph.replay()
    return _median_replay_seconds(graph) / num_layers


def measure_hbm_bytes_per_s(num_bytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read + bytes written per second."""
    from triton.testing import do_bench

    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * num_bytes / (ms * 1e-3)


_SPLIT_SWEEP = (1, 2, 4, 8, 16, 32)


def bench_attention(
    hbm_bytes_per_s: float | None = None,
    *,
    batches: tuple[int, ...] = DECODE_BATCHES,
    contexts: tuple[int, ...] = DECODE_CONTEXTS,
    shape: AttentionShape = LLAMA_8B,
    dtype: torch.dtype = torch.bfloat16,
) -> list[dict]:
    """Time decode attention per (batch, context); one JSON-ready dict per point.

    ``hbm_bytes_per_s`` is the ceiling to judge against (measured by a copy when None).
    """
    from triton.testing import do_bench

    from ember.kernels.attention_plan import choose_num_kv_splits
    from ember.kernels.paged_attention import paged_attention

    if hbm_bytes_per_s is None:
        hbm_bytes_per_s = measure_hbm_bytes_per_s()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    scale = shape.head_dim**-0.5
    elem = torch.tensor([], dtype=dtype).element_size()
    rows = []
    for context in contexts:
        for batch in batches:
            inputs = decode_inputs(shape, batch, context, dtype)
            out = torch.empty_like(inputs["q"])
            splits = choose_num_kv_splits(batch, shape.num_kv_heads, context, num_sms)

            def run(num_kv_splits=None, inputs=inputs, out=out, context=context):
                paged_attention(**inputs, scale=scale, out=out, max_query_len=1,
                                max_seq_len=context, num_kv_splits=num_kv_splits,
                                num_sms=num_sms)  # fmt: skip

            seconds = gpu_seconds(run)
            moved = decode_attention_bytes(shape, batch, context, elem)
            row = {
                "batch": batch,
                "context": context,
                "kv_splits": splits,
                "us": seconds * 1e6,
                "eager_us": do_bench(run, return_mode="median") * 1e3,  # with launch overhead
                "bytes": moved,
                "gb_per_s": moved / seconds / 1e9,
                "roofline_us": moved / hbm_bytes_per_s * 1e6,
                "roofline_fraction": moved / hbm_bytes_per_s / seconds,
            }
            if splits > 1:
                row["unsplit_us"] = gpu_seconds(lambda run=run: run(1)) * 1e6
            # Every split count that leaves each segment a 64-key tile or more, so the split
            # heuristic can be checked against the best one measured.
            row["us_by_splits"] = {
                n: gpu_seconds(lambda run=run, n=n: run(n)) * 1e6
                for n in _SPLIT_SWEEP
                if n * 64 <= context
            }
            rows.append(row)
            del inputs, out
    torch.cuda.empty_cache()
    return rows


def bench_prefill_attention(
    chunks: tuple[int, ...] = (512, 2048, 8192),
    *,
    shape: AttentionShape = LLAMA_8B,
    dtype: torch.dtype = torch.bfloat16,
    bf16_flops_per_s: float = 790e12,
) -> list[dict]:
    """One causal prefill chunk from position 0: time against the bf16 tensor-core peak."""
    from triton.testing import do_bench

    from ember.kernels.paged_attention import paged_attention

    rows = []
    for chunk in chunks:
        inputs = decode_inputs(shape, 1, chunk, dtype)
        q = torch.randn(chunk, shape.num_q_heads, shape.head_dim, dtype=dtype, device="cuda")
        inputs.update(q=q, query_start_loc=torch.tensor([0, chunk], dtype=torch.int32,
                                                        device="cuda"))  # fmt: skip
        out = torch.empty_like(q)
        seconds = 1e-3 * do_bench(
            lambda inputs=inputs, out=out, chunk=chunk: paged_attention(
                **inputs, scale=shape.head_dim**-0.5, out=out, max_query_len=chunk,
                max_seq_len=chunk,
            ),
            return_mode="median",
        )  # fmt: skip
        # QK^T and PV over the causal half of the score matrix.
        flops = 2 * 2 * shape.num_q_heads * shape.head_dim * chunk * (chunk + 1) / 2
        rows.append({"chunk": chunk, "us": seconds * 1e6, "tflops": flops / seconds / 1e12,
                     "fraction_of_bf16_peak": flops / seconds / bf16_flops_per_s})  # fmt: skip
    return rows


def bench_sampling(
    batches: tuple[int, ...] = (1, 64, 256), vocab: int = 151_936
) -> list[dict]:  # fmt: skip
    """The sampler per batch size on a Qwen-sized vocabulary: plain temperature sampling (one
    pass) and top-k 50 + top-p 0.9 (the threshold search), with logits-read time for scale."""
    from ember.kernels.sampling import sample

    rows = []
    for batch in batches:
        logits = torch.randn(batch, vocab, device="cuda") * 4
        ones = torch.ones(batch, device="cuda")
        ids = torch.arange(batch, device="cuda")
        cases = {
            "plain": (ones, 0, 1.0),
            "top_k50_top_p0.9": (ones, 50, 0.9),
            "top_p0.95": (ones, 0, 0.95),
        }
        for name, (temperature, top_k, top_p) in cases.items():
            args = (logits, temperature, torch.full_like(ids, top_k, dtype=torch.int32),
                    torch.full_like(ones, top_p), torch.zeros_like(ones), ids, ids)  # fmt: skip
            seconds = gpu_seconds(lambda args=args: sample(*args))
            rows.append({"batch": batch, "case": name, "us": seconds * 1e6,
                         "logits_gb_per_s": logits.numel() * 4 / seconds / 1e9})  # fmt: skip
    return rows


def main() -> None:
    """``python -m ember.bench.kernel_bench``: print one JSON line per point."""
    import json

    if not torch.cuda.is_available():
        raise SystemExit("kernel_bench needs a CUDA GPU")
    for row in bench_attention() + bench_prefill_attention() + bench_sampling():
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
