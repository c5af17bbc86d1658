"""One-off GPU probe: what batch 256's decode step costs in joules, part by part, on one machine.

At the 700 W limit a step's time is its energy over the limit (bench/results/README.md, "Batch
256 at the power limit"). The bounds so far come from two machines: the parts' energy from one,
the fastest step from another. This reads, in one process on one machine, each workload held
for 3 s from a CUDA graph (`ember.bench.roofline.sustained_rate`) with its energy per step:

- ``idle``: the card doing nothing for 2 s (the per-second floor);
- ``gemms``: the step's GEMMs at 256 rows (`ember.bench.tune_sustained.decode_gemms`);
- ``attention``: the step's decode attention, 256 x 512, 32 layers (the engine's kernel);
- ``read_flat``: the same 32 layers' K/V caches read whole, front to back, by a plain Triton
  reduction: the least a read of those bytes costs;
- ``read_pages``: the same caches read through the block tables as attention reads them (one
  program per sequence and KV head, a page of 16 tokens x 128 dims at a time, 256 B rows 2 KB
  apart), summed and nothing else: attention's access pattern without its math;
- ``read_pages_head_major``: as ``read_pages`` with each page's 16 rows of one KV head
  contiguous (4 KB), as a ``[blocks, kv_heads, page, head_dim]`` cache would hold them;
- ``read_pages_evict_first``: as ``read_pages`` with the loads marked evict-first in L2;
- ``gemms_with_attention``: the GEMMs with each layer's attention between its q/k/v and o, as a
  step orders them (no norms, activation, RoPE or sampling): the two parts at the clock they
  share in a step;
- ``gemms_with_read_pages``: the same with ``read_pages`` of each layer in attention's place,
  the least such a step could spend on its K/V;
- ``gemms_with_step_kernels``: ``gemms_with_attention`` plus the engine's add + RMSNorm after o
  and after down (summing their split-K halves), SiLU-and-multiply after gate/up and the greedy
  argmax after the logits: a step's kernels at 256 rows but for embedding, the final norm, and
  RoPE with the K/V write (so the real step's energy, less this, is what its engine adds).

So attention's joules split into what the bytes cost read plainly, what its access pattern adds,
and what its math adds; and the GEMMs' and attention's together stand against the whole step's
(`ember bench step`'s held-graph power, run in the same call).

    python docs/wip/probe_energy_ledger.py OUT.json
    python docs/wip/probe_energy_ledger.py --profile OUT.json   # gemms_with_step_kernels' kernels
    python docs/wip/probe_energy_ledger.py --placement OUT.json # attention, pages shuffled or not
    TRITON_INTERPRET=1 python docs/wip/probe_energy_ledger.py --check   # the readers, on a CPU
"""

from __future__ import annotations

import json
import sys
import time
from functools import partial

import torch
import triton
import triton.language as tl

ROWS, CONTEXT, SECONDS = 256, 512, 3.0


@triton.jit
def _read_flat(x_ptr, out_ptr, PER_PROGRAM: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    base = x_ptr + pid.to(tl.int64) * PER_PROGRAM
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, PER_PROGRAM, BLOCK):
        acc += tl.load(base + start + tl.arange(0, BLOCK)).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


@triton.jit
def _read_pages(k_ptr, v_ptr, tables_ptr, out_ptr, stride_page, stride_token, stride_head,
                PAGES_PER_SEQ: tl.constexpr, NUM_KV_HEADS: tl.constexpr, PAGE: tl.constexpr,
                HEAD_DIM: tl.constexpr, EVICTION: tl.constexpr):  # fmt: skip
    seq, head = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, PAGE)[:, None] * stride_token + tl.arange(0, HEAD_DIM)[None, :]
    acc = tl.zeros([PAGE, HEAD_DIM], tl.float32)
    for i in range(PAGES_PER_SEQ):
        page = tl.load(tables_ptr + seq * PAGES_PER_SEQ + i).to(tl.int64)
        offsets = page * stride_page + head * stride_head + rows
        k = tl.load(k_ptr + offsets, eviction_policy=EVICTION)
        v = tl.load(v_ptr + offsets, eviction_policy=EVICTION)
        acc += k.to(tl.float32) + v.to(tl.float32)
    tl.store(out_ptr + seq * NUM_KV_HEADS + head, tl.sum(tl.sum(acc, axis=1), axis=0))


def read_flat(tensors: list[torch.Tensor], outs: torch.Tensor) -> None:
    """Each tensor read whole, front to back, one program per page (32 KB at the 8B shape)."""
    for x, out in zip(tensors, outs):
        per_program = x[0].numel()
        block = min(2048, per_program)
        _read_flat[(x.shape[0],)](x, out, PER_PROGRAM=per_program, BLOCK=block, num_warps=4,
                                  num_stages=3)  # fmt: skip


def read_pages(layers: list[dict], outs: torch.Tensor, head_major: bool,
               eviction: str = "") -> None:  # fmt: skip
    """K and V of every sequence's pages, one program per (sequence, KV head); ``eviction``:
    the loads' L2 eviction policy (``evict_first``: streamed, kept from displacing other data)."""
    for inputs, out in zip(layers, outs):
        k, v, tables = inputs["k_cache"], inputs["v_cache"], inputs["block_tables"]
        _, page, heads, dim = k.shape
        if head_major:  # the same bytes seen as [pages, heads, page, dim]
            stride_token, stride_head = dim, page * dim
        else:
            stride_token, stride_head = heads * dim, dim
        _read_pages[(tables.shape[0], heads)](
            k, v, tables, out, page * heads * dim, stride_token, stride_head,
            PAGES_PER_SEQ=tables.shape[1], NUM_KV_HEADS=heads, PAGE=page, HEAD_DIM=dim,
            EVICTION=eviction, num_warps=1, num_stages=4,
        )  # fmt: skip


def check(device: str = "cpu") -> None:
    """The readers' sums against torch's on a small random pool."""
    from ember.bench.kernel_bench import LLAMA_8B, decode_inputs

    layers = [decode_inputs(LLAMA_8B, 3, 40, torch.float32, device=device) for _ in range(2)]
    outs = torch.zeros(2, 3 * LLAMA_8B.num_kv_heads, device=device)
    for head_major in (False, True):
        read_pages(layers, outs, head_major)
        for inputs, out in zip(layers, outs):
            k, v = inputs["k_cache"], inputs["v_cache"]
            if head_major:
                k = k.reshape(k.shape[0], k.shape[2], k.shape[1], k.shape[3]).transpose(1, 2)
                v = v.reshape(v.shape[0], v.shape[2], v.shape[1], v.shape[3]).transpose(1, 2)
            pages = inputs["block_tables"].long()
            want = (k[pages] + v[pages]).sum(dim=(1, 2, 4)).reshape(-1)  # [seq, head]
            torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-3)
    tensors = [inputs["k_cache"] for inputs in layers]
    flat_outs = torch.zeros(2, tensors[0].shape[0], device=device)
    read_flat(tensors, flat_outs)
    for x, out in zip(tensors, flat_outs):
        torch.testing.assert_close(out.sum(), x.sum(), rtol=1e-4, atol=1e-2)
    print("readers match torch")


def _attention_after_qkv(caches: list[dict], out: torch.Tensor, name: str, layer: int,
                         _product: torch.Tensor) -> None:  # fmt: skip
    from ember.bench.tune_sustained import attend_one_layer

    if name == "qkv":
        attend_one_layer(caches[layer], out, CONTEXT)


def _read_after_qkv(caches: list[dict], outs: torch.Tensor, name: str, layer: int,
                    _product: torch.Tensor) -> None:  # fmt: skip
    if name == "qkv":
        read_pages(caches[layer : layer + 1], outs[layer : layer + 1], head_major=False)


def _step_kernels_after(attention_after, buffers: dict, name: str, layer: int,
                        product: torch.Tensor) -> None:  # fmt: skip
    """The engine's kernels after each product, on buffers of a step's shapes."""
    from ember.kernels import add_parts_rms_norm, fused_add_rms_norm, greedy_argmax, silu_and_mul

    attention_after(name, layer, product)
    if name in ("o", "down") and product.dim() == 3:  # split-K halves, summed by the norm
        add_parts_rms_norm(buffers["residual"], product, buffers["norm_weight"], 1e-5,
                           out=buffers["normed"])  # fmt: skip
    elif name in ("o", "down"):
        fused_add_rms_norm(product, buffers["residual"], buffers["norm_weight"], 1e-5)
    elif name == "gate_up":
        silu_and_mul(product, out=buffers["activation"])
    elif name == "lm_head":
        greedy_argmax(product)


def _step_buffers(preset: str) -> dict:
    from ember.bench.tune import linear_shapes

    shapes = {name: (n, k) for name, n, k in linear_shapes(preset)}
    hidden = shapes["o"][0]

    def new(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=torch.bfloat16, device="cuda")

    return {"residual": new(ROWS, hidden), "normed": new(ROWS, hidden),
            "norm_weight": new(hidden), "activation": new(ROWS, shapes["gate_up"][0] // 2)}  # fmt: skip


def held(name: str, fn, work: float, nvml_handle, unit: str) -> dict:
    from ember.bench.roofline import sustained_rate
    from ember.bench.tune_sustained import held_energy

    rate = sustained_rate(fn, work, SECONDS, calls_per_graph=1, nvml_handle=nvml_handle)
    seconds = work / rate.sustained_per_s
    row = {"workload": name, "unit": unit, "work_per_step": work, "step_ms": seconds * 1e3,
           **rate.as_dict(), **held_energy(rate, seconds)}  # fmt: skip
    print(json.dumps({k: row.get(k) for k in ("workload", "step_ms", "energy_j_per_step",
                                              "sampled_energy_j_per_step")}
                     | {"clock": (rate.power.sm_clock_mhz_median if rate.power else None)}),
          flush=True)  # fmt: skip
    return row


def main(out_path: str) -> int:
    from ember.bench.gpu_power import measure_power, open_nvml
    from ember.bench.tune_sustained import decode_attention, decode_attention_layers, decode_gemms

    nvml_handle = open_nvml()
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    time.sleep(1.0)
    _, idle = measure_power(nvml_handle, lambda: time.sleep(2.0))
    result = {"gpu": torch.cuda.get_device_name(), "idle": idle.as_dict() if idle else None,
              "rows": ROWS, "context": CONTEXT, "cases": []}  # fmt: skip

    def save() -> None:
        with open(out_path, "w") as f:
            json.dump(result, f, indent=1)

    caches = decode_attention_layers(ROWS, CONTEXT)
    attention, moved = decode_attention(ROWS, CONTEXT, caches)
    page_outs = torch.empty(len(caches), ROWS * caches[0]["k_cache"].shape[2], device="cuda")
    attention_after = partial(_attention_after_qkv, caches, torch.empty_like(caches[0]["q"]))
    read_after = partial(_read_after_qkv, caches, page_outs)
    step_kernels_after = partial(_step_kernels_after, attention_after,
                                 _step_buffers("llama-3.1-8b"))  # fmt: skip
    for name, after in (("gemms", None), ("gemms_with_attention", attention_after),
                        ("gemms_with_read_pages", read_after),
                        ("gemms_with_step_kernels", step_kernels_after)):  # fmt: skip
        fn, flops = decode_gemms("llama-3.1-8b", ROWS, after=after)
        result["cases"].append(held(name, fn, flops, nvml_handle, "flops"))
        del fn
        torch.cuda.empty_cache()
        save()
    kv_bytes = sum(t.numel() * t.element_size() for inputs in caches
                   for t in (inputs["k_cache"], inputs["v_cache"]))  # fmt: skip
    page_bytes = sum(2 * inputs["block_tables"].numel() * inputs["k_cache"][0].numel()
                     * inputs["k_cache"].element_size() for inputs in caches)  # fmt: skip
    result["cases"].append(held("attention", attention, moved, nvml_handle, "bytes"))
    save()
    flat_outs = torch.empty(2 * len(caches), caches[0]["k_cache"].shape[0], device="cuda")
    tensors = [t for inputs in caches for t in (inputs["k_cache"], inputs["v_cache"])]
    result["cases"].append(held("read_flat", lambda: read_flat(tensors, flat_outs),
                                kv_bytes, nvml_handle, "bytes"))  # fmt: skip
    save()
    readers = (("read_pages", False, ""), ("read_pages_head_major", True, ""),
               ("read_pages_evict_first", False, "evict_first"))  # fmt: skip
    for name, head_major, eviction in readers:
        result["cases"].append(held(name, partial(read_pages, caches, page_outs, head_major,
                                                  eviction), page_bytes, nvml_handle, "bytes"))  # fmt: skip
        save()
    return 0


def profile(out_path: str, hold_seconds: float = 2.0, replays: int = 10) -> int:
    """``gemms_with_step_kernels``' kernels, µs a step by kernel (torch.profiler), after the
    graph is held ``hold_seconds`` so the clocks are the capped ones a step sees."""
    from ember.bench.step_profile import _kernel_events, summarize_kernels
    from ember.bench.tune_sustained import decode_attention_layers, decode_gemms

    caches = decode_attention_layers(ROWS, CONTEXT)
    after = partial(_step_kernels_after,
                    partial(_attention_after_qkv, caches, torch.empty_like(caches[0]["q"])),
                    _step_buffers("llama-3.1-8b"))  # fmt: skip
    fn, _ = decode_gemms("llama-3.1-8b", ROWS, after=after)
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    deadline = time.perf_counter() + hold_seconds
    while time.perf_counter() < deadline:
        graph.replay()
        torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    spans = _kernel_events(prof)
    summary = summarize_kernels([(name, end - begin) for name, begin, end in spans], replays)
    summary["wall_us_per_step"] = wall / replays * 1e6
    print(json.dumps(summary), flush=True)
    with open(out_path, "w") as f:
        json.dump(summary, f, indent=1)
    return 0


def placement(out_path: str) -> int:
    """Decode attention held alone with each sequence's pages shuffled over the pool (as
    `decode_inputs` makes them) and in order, a sequence's pages side by side (as the engine's
    first-in-first-out block pool hands them out to requests admitted together)."""
    from ember.bench.gpu_power import open_nvml
    from ember.bench.tune_sustained import decode_attention, decode_attention_layers

    nvml_handle = open_nvml()
    caches = decode_attention_layers(ROWS, CONTEXT)
    shuffled = [inputs["block_tables"] for inputs in caches]
    in_order = torch.arange(1, shuffled[0].numel() + 1, dtype=torch.int32, device="cuda")
    in_order = [in_order.view_as(shuffled[0])] * len(caches)
    rows = []
    for name, tables in (("shuffled", shuffled), ("in_order", in_order),
                         ("shuffled_again", shuffled)):  # fmt: skip
        for inputs, table in zip(caches, tables):
            inputs["block_tables"] = table
        attention, moved = decode_attention(ROWS, CONTEXT, caches)
        rows.append(held(f"attention_pages_{name}", attention, moved, nvml_handle, "bytes"))
        with open(out_path, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    if sys.argv[1] == "--placement":
        sys.exit(placement(sys.argv[2]))
    if sys.argv[1:] == ["--check"]:
        check()
        sys.exit(0)
    if sys.argv[1] == "--profile":
        sys.exit(profile(sys.argv[2]))
    sys.exit(main(sys.argv[1]))
