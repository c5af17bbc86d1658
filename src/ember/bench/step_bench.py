"""`ember bench step`: engine step times on a GPU against the roofline measured in the same run.

Decode steps are measured through the engine loop (scheduler, runner, CUDA graphs, overlap; the
loop of `ember.bench.host_phases`, which times the host's phases): B requests start with L-1
tokens of context already in a KV cache filled with random values, so every timed step is a pure
decode at context ~L. Prefill is one chunk of C prompt tokens. A mixed step, serving's usual one,
is B such decodes beside a prompt of C tokens that arrives before every step.
"""

from __future__ import annotations

import argparse
import json
import time
from functools import partial
from pathlib import Path

import torch

from ember import cli
from ember.bench.gpu_power import open_nvml, power_window
from ember.bench.host_phases import TimedLoop
from ember.bench.roofline import (
    Ceilings,
    gpu_seconds,
    measure_ceilings,
    measure_sustained,
    time_cuda,
)
from ember.config import KV_CACHE_DTYPES, MemoryConfig, engine_config
from ember.engine.gc_heap import SLOW_PASS_S, GcPauses, freeze_startup_heap
from ember.engine.model_instance import ModelInstance
from ember.runner.model_runner import ModelRunner
from ember.sampling_params import SamplingParams

# Float16 draws an FP8 cache is filled by at a time (256 MiB).
_FILL_ELEMENTS = 128 << 20

DECODE_BATCHES = (1, 8, 32, 64, 128, 256)
DECODE_CONTEXTS = (512, 4096)
PREFILL_CHUNKS = (512, 1024, 2048, 4096, 8192)
# (decodes, their context, prompt chunk): the profile's serving-like step at several batches,
# and a few long decodes beside a chunk (where one attention launch per step kind queues the
# decodes before the chunk).
MIXED_STEPS = ((8, 512, 512), (64, 512, 512), (200, 512, 512), (1, 4096, 512), (4, 4096, 2048))


class StepBench:
    def __init__(
        self,
        instance: ModelInstance,
        ceilings: Ceilings,
        sustained: Ceilings | None = None,
        nvml_handle=None,
    ) -> None:
        """``ceilings``: the burst ceilings every roofline is taken against; ``sustained``: the
        same held for seconds (at the power limit), for the capped sequential roofline;
        ``nvml_handle`` (`ember.bench.gpu_power.open_nvml`): read the power over timed steps."""
        self.inst = instance
        self.ceil = ceilings
        self.sustained = sustained
        self.nvml_handle = nvml_handle
        # One tensor-parallel rank's share (the whole model on one GPU): every floor is one
        # GPU's, which reads its heads' KV and its slice of the weights (of every expert).
        cfg = instance.plan.rank_config
        self.cfg = cfg
        kv_elem = instance.plan.kv_elem_bytes  # 1 for an FP8 cache
        self.kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * kv_elem
        # Every GEMM weight is read once per step, at its own element size (an FP8 weight's one
        # byte, with its row scales; MXFP4 experts' packed half byte, with their group scales);
        # the embedding table only row by row.
        streamed = [
            (name, p)
            for name, p in instance.model.named_parameters()
            if cfg.tie_word_embeddings or name != "embed_tokens.weight"
        ]
        self.matmul_params = sum(_matmul_elements(name, p) for name, p in streamed)
        # A token multiplies by its top-k experts only: of a mixture of experts' stacked
        # experts, k/E of the elements count in each token's FLOPs.
        expert_elements = sum(
            _matmul_elements(name, p) for name, p in streamed if _is_expert_weight(name)
        )
        unchosen = 1 - cfg.num_experts_per_tok / cfg.num_experts if expert_elements else 0
        self.token_matmul_params = self.matmul_params - expert_elements * unchosen
        self.weight_bytes = sum(p.numel() * p.element_size() for _, p in streamed)
        # A mixture of experts' decode step reads only its tokens' chosen experts.
        self.expert_bytes = sum(
            p.numel() * p.element_size() for name, p in streamed if _is_expert_weight(name)
        )
        self.loop = TimedLoop.of(instance)
        self._ids = 0

    def sync(self) -> None:
        if self.inst.device.type == "cuda":
            torch.cuda.synchronize()

    def step(self) -> None:
        """One engine step, through the bench's loop."""
        self.loop.step()

    def _attn_flops(self, queries: int, context: float) -> float:
        cfg = self.cfg
        return 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * queries * context

    def add_warm_request(self, context: int, max_tokens: int) -> str:
        """A request whose first context-1 tokens are already 'in' the cache."""
        inst = self.inst
        self._ids += 1
        rid = f"bench-{self._ids}"
        prompt = torch.randint(3, self.cfg.vocab_size, (context,)).tolist()
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        request = inst.make_request(rid, prompt, params)
        kv = inst.kv_manager
        # A chunk at a time, giving back what windows pass as a scheduler would (a windowed
        # pool holds only the windows).
        chunk = inst.limits.max_num_batched_tokens
        for end in range(min(chunk, context - 1), context - 1 + chunk, chunk):
            end = min(end, context - 1)
            if kv.allocate_slots(rid, end) is None:
                raise MemoryError("KV pool exhausted")
            request.num_computed_tokens = end
            kv.release_out_of_window(request)
        inst.scheduler.add_request(request)
        return rid

    def drain(self, ids: list[str]) -> None:
        """Abort ``ids`` and step until nothing is left, the runner told of every request gone
        (the loop's runner may be swapped afterwards)."""
        for rid in ids:
            self.inst.abort(rid)
        self.step()
        while self.loop.has_work():
            self.step()

    def _kv_shortfall(self, need: int) -> str | None:
        """Why a row of ``need`` KV tokens is skipped, or None if the pool holds them."""
        inst = self.inst
        if need <= inst.kv_manager.pool.capacity * inst.kv_manager.block_size:
            return None
        gib = need * self.kv_bytes_per_token / 2**30
        return f"KV for {need} tokens ({gib:.0f} GiB) exceeds the pool"

    def _timed_steps(self, step, steps: int, warmup: int) -> tuple[float, dict, dict]:
        """``step()`` ``warmup`` times, then ``steps`` timed times: seconds per step, the host's
        ms per step by phase of the loop, and the garbage collector's passes
        (`GcPauses.summary`: a generation-2 pass stalls the loop for its whole length)."""
        for _ in range(warmup):
            step()
        self.sync()
        self.loop.reset()
        with GcPauses(slow_pass_s=SLOW_PASS_S) as gc_pauses:
            start = time.perf_counter()
            for _ in range(steps):
                step()
            self.sync()
            step_s = (time.perf_counter() - start) / steps
        host_ms = {name: sec / steps * 1e3 for name, sec in self.loop.seconds.items()}
        return step_s, host_ms, gc_pauses.summary(steps)

    def decode(self, batch: int, context: int, steps: int = 40, warmup: int = 8) -> dict:
        row = {"batch": batch, "context": context}
        if shortfall := self._kv_shortfall(batch * (context + steps + warmup + 2)):
            return {**row, "skipped": shortfall}
        ids = [self.add_warm_request(context, steps + warmup + 4) for _ in range(batch)]
        step_s, host_ms, gc_pauses = self._timed_steps(self.step, steps, warmup)
        gpu_s = self._gpu_only_step_seconds(batch, context + warmup + steps)
        power = self._held_graph_power(batch, context + warmup + steps)
        self.drain(ids)
        ctx = context + (warmup + steps / 2)
        kv_bytes = batch * ctx * self.kv_bytes_per_token
        bytes_moved = self.weight_bytes + kv_bytes
        gemm_flops, attn_flops = 2 * self.token_matmul_params * batch, self._attn_flops(batch, ctx)
        flops = gemm_flops + attn_flops
        floor = self.ceil.floor_seconds(bytes_moved, flops)
        # The GEMMs and attention run one after the other, so a step can't overlap the GEMMs'
        # compute with attention's KV reads: the sum of the two floors is the reachable bound.
        sequential_floor = self._sequential_floor(self.ceil, kv_bytes, gemm_flops, attn_flops)
        capped = {}
        if self.sustained is not None:
            # The same bound at the ceilings held for seconds: where the power limit has set
            # the clocks, as it does over a run of steps.
            capped_floor = self._sequential_floor(self.sustained, kv_bytes, gemm_flops, attn_flops)
            capped = {
                "capped_sequential_roofline_ms": capped_floor * 1e3,
                "fraction_of_capped_sequential_roofline": capped_floor / step_s,
            }
        return {
            **row,
            "step_ms": step_s * 1e3,
            "gpu_only_ms": gpu_s * 1e3 if gpu_s else None,
            "gpu_idle_fraction": (1 - gpu_s / step_s) if gpu_s else None,
            "tokens_per_s": batch / step_s,
            # The host's busy time per step is step_ms less the wait: at step_ms it is the bound.
            "host_ms_per_step": host_ms,
            "gc": gc_pauses,
            "roofline_ms": floor * 1e3,
            "fraction_of_roofline": floor / step_s,
            "sequential_roofline_ms": sequential_floor * 1e3,
            "fraction_of_sequential_roofline": sequential_floor / step_s,
            **capped,
            **self._selected_experts_floor(batch, kv_bytes, gemm_flops, attn_flops, step_s),
            "bytes_moved": bytes_moved,
            "flops": flops,
            "power": power,
        }

    def _selected_experts_floor(
        self, batch: int, kv_bytes: float, gemm_flops: float, attn_flops: float, step_s: float
    ) -> dict:
        """For a mixture of experts: the sequential floor of a step that reads, of each MoE
        layer's experts, only as many as ``batch`` tokens choose when the router spreads them
        uniformly (`expected_chosen_experts`); {} for a dense model."""
        cfg = self.cfg
        if not self.expert_bytes:
            return {}
        chosen = expected_chosen_experts(cfg.num_experts, cfg.num_experts_per_tok, batch)
        weight_bytes = self.weight_bytes - self.expert_bytes * (1 - chosen / cfg.num_experts)
        floor = self.ceil.floor_seconds(weight_bytes, gemm_flops) + self.ceil.floor_seconds(
            kv_bytes, attn_flops
        )
        return {
            "expected_chosen_experts": chosen,
            "chosen_experts_roofline_ms": floor * 1e3,
            "fraction_of_chosen_experts_roofline": floor / step_s,
        }

    def _sequential_floor(
        self, ceilings: Ceilings, kv_bytes: float, gemm_flops: float, attn_flops: float
    ) -> float:
        """The GEMMs' floor plus attention's, at ``ceilings``."""
        return ceilings.floor_seconds(self.weight_bytes, gemm_flops) + ceilings.floor_seconds(
            kv_bytes, attn_flops
        )

    def mixed(self, batch: int, context: int, chunk: int, steps: int = 12, warmup: int = 3) -> dict:
        """Steps of ``batch`` decodes at ~``context`` tokens, each beside a new prompt of
        ``chunk`` tokens (added before the step; it ends with its prefill: max_tokens 1)."""
        inst = self.inst
        row = {"batch": batch, "context": context, "chunk": chunk}
        if shortfall := self._kv_shortfall(batch * (context + steps + warmup + 2) + 2 * chunk):
            return {**row, "skipped": shortfall}
        ids = [self.add_warm_request(context, steps + warmup + 4) for _ in range(batch)]
        prompts = []

        def step_beside_a_new_prompt() -> None:
            self._ids += 1
            tokens = torch.randint(3, self.cfg.vocab_size, (chunk,)).tolist()
            params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
            prompts.append(inst.add_request(f"prompt-{self._ids}", tokens, params))
            self.step()

        step_s, host_ms, gc_pauses = self._timed_steps(step_beside_a_new_prompt, steps, warmup)
        prefilled = sum(p.num_computed_tokens >= chunk for p in prompts)
        self.drain(ids + [p.request_id for p in prompts])
        return {
            **row,
            "step_ms": step_s * 1e3,
            "decode_tokens_per_s": batch / step_s,
            "prefill_tokens_per_s": chunk / step_s,
            "host_ms_per_step": host_ms,
            "gc": gc_pauses,
            # How many of the prompts were through their prefill when the timing ended (all but
            # the last step's, which may still be in flight): each timed step was mixed.
            "prompts_prefilled": prefilled,
            "prompts": len(prompts),
        }

    def _gpu_only_step_seconds(
        self, batch: int, max_seq_len: int, replays: int = 5
    ) -> float | None:
        """Replays the decode graph of the loop's last steps (their length class) back to back:
        the step's GPU time with no CPU in between. Each timing spans ``replays`` replays queued
        at once (a replay timed alone, with a sync before the next, reads above the loop's whole
        step). Queued replays can still read above the loop, so the idle fraction taken from
        them is an estimate; ``host_ms_per_step`` is the direct measure."""
        graphs, bucket = self.loop.runner.graphs, self._captured_bucket(batch, max_seq_len)
        if bucket is None:
            return None

        def replay_all() -> None:
            for _ in range(replays):
                graphs.replay(bucket)

        return time_cuda(replay_all, warmup=1, repeat=8) / replays

    def _captured_bucket(self, batch: int, max_seq_len: int):
        """The captured decode graph's key a step of ``batch`` at ``max_seq_len`` replays, or
        None (no graphs, or none captured for it)."""
        graphs = self.loop.runner.graphs
        bucket = graphs.bucket_for(batch, max_seq_len) if graphs else None
        return bucket if bucket is not None and bucket in graphs.captured else None

    def _held_graph_power(
        self, batch: int, max_seq_len: int, seconds: float = 2.0, batch_seconds: float = 0.05
    ) -> dict | None:
        """The decode graph of `_gpu_only_step_seconds` replayed for ``seconds`` (the loop's
        steps last well under one, too short for NVML's energy counter), in batches synchronized
        every ``batch_seconds``: the GPU's power at that step held (`ember.bench.gpu_power`),
        its energy per step and the step's GPU time over the window. None without NVML."""
        graphs, bucket = self.loop.runner.graphs, self._captured_bucket(batch, max_seq_len)
        if self.nvml_handle is None or bucket is None:
            return None
        one = time_cuda(lambda: graphs.replay(bucket), warmup=1, repeat=3)
        per_batch = max(1, round(batch_seconds / one))
        batches = max(1, round(seconds / (per_batch * one)))
        with power_window(self.nvml_handle) as window:
            for _ in range(batches):
                for _ in range(per_batch):
                    graphs.replay(bucket)
                self.sync()
        reading, replays = window.reading, batches * per_batch
        return {
            **reading.as_dict(),
            "energy_j_per_step": reading.energy_j / replays,
            "held_step_ms": reading.seconds / replays * 1e3,
        }

    def eager_vs_graph(self, batch: int, context: int = 512) -> dict:
        """A decode row with the instance's runner, then with a runner of no CUDA graphs over
        the same model, cache and scheduler."""
        with_graphs = self.decode(batch, context)
        loop = self.loop
        self.loop = TimedLoop.of(self.inst, self._eager_runner())
        try:
            eager = self.decode(batch, context)
        finally:
            self.loop = loop
        return {
            "batch": batch,
            "context": context,
            "graph_step_ms": with_graphs.get("step_ms"),
            "eager_step_ms": eager.get("step_ms"),
            "speedup": eager["step_ms"] / with_graphs["step_ms"] if "step_ms" in eager else None,
        }

    def _eager_runner(self) -> ModelRunner:
        inst, runner = self.inst, self.inst.runner
        return ModelRunner(
            model=inst.model,
            attention=inst.attention,
            kv_cache=inst.kv_cache,
            cos_sin_cache=runner.cos_sin_cache,
            block_size=runner.block_size,
            sampler=runner.sampler,
            stop_ids_until_min_tokens=runner.stop_ids_until_min_tokens,
            limits=inst.limits,
            use_cuda_graphs=False,
            local_layers=runner.local_layers,
        )

    def prefill(self, chunk: int, repeat: int = 3) -> dict:
        inst = self.inst
        times = []
        for _ in range(repeat + 1):
            self._ids += 1
            rid = f"prefill-{self._ids}"
            prompt = torch.randint(3, self.cfg.vocab_size, (chunk,)).tolist()
            inst.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=1))
            self.sync()
            start = time.perf_counter()
            self.step()
            self.sync()
            times.append(time.perf_counter() - start)
            self.drain([rid])
        seconds = sorted(times[1:])[len(times[1:]) // 2]
        flops = 2 * self.token_matmul_params * chunk + self._attn_flops(chunk, chunk / 2)
        floor = self.ceil.floor_seconds(self.weight_bytes + chunk * self.kv_bytes_per_token, flops)
        return {
            "chunk": chunk,
            "step_ms": seconds * 1e3,
            "tokens_per_s": chunk / seconds,
            "tflops": flops / seconds / 1e12,
            "fraction_of_bf16_peak": flops / seconds / self.ceil.bf16_flops_per_s,
            "fraction_of_roofline": floor / seconds,
        }


# A mixture of experts' stacked tensors (`ember.models.moe.SparseMoeBlock`): plain or FP8
# weights and their row scales, MXFP4 ones' packed blocks and group scales, biases.
_EXPERT_TENSORS = frozenset(
    {"w13", "w2", "w13_scale", "w2_scale", "w13_blocks", "w2_blocks", "w13_scales", "w2_scales"}
    | {"b13", "b2"}
)


def _is_expert_weight(name: str) -> bool:
    """Whether parameter ``name`` is a stacked expert tensor, read only for the experts a step
    chooses."""
    return name.rsplit(".", 1)[-1] in _EXPERT_TENSORS


def _matmul_elements(name: str, param: torch.Tensor) -> int:
    """The weight elements parameter ``name`` multiplies by: none for scales (FP8 rows', MXFP4
    groups'), two a byte for MXFP4's packed blocks, else one an element."""
    if name.endswith(("_scale", "_scales")):
        return 0
    return 2 * param.numel() if name.endswith("_blocks") else param.numel()


def expected_chosen_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """How many of ``num_experts`` experts ``tokens`` tokens choose between them, each ``top_k``
    distinct ones uniformly at random: each expert is missed by a token with probability
    1 - k/E, so E (1 - (1 - k/E)^T) are chosen on average."""
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


def fill_normal(kv_cache: torch.Tensor, std: float) -> None:
    """Fill the cache with N(0, std) values a layer at a time (torch draws no float8: an FP8
    cache takes them rounded from float16, `_FILL_ELEMENTS` at a time, so the draws need no more
    than a slice of memory)."""
    for layer in kv_cache:
        if layer.element_size() != 1:
            layer.normal_(0, std)
            continue
        for part in layer.view(-1).split(_FILL_ELEMENTS):
            part.copy_(torch.randn(part.shape, dtype=torch.float16, device=part.device) * std)


def bench_instance(
    model: str,
    max_model_len: int,
    max_num_batched_tokens: int = 8192,
    ceilings: Ceilings | None = None,
    engine_options: dict | None = None,
) -> tuple[ModelInstance, Ceilings]:
    """The GPU's measured ceilings (unless given) and a model instance sized for the step
    benchmarks; ``engine_options``: further `engine_config` options (the fast-path flags')."""
    ceilings = ceilings or measure_ceilings()
    options = {
        "max_num_seqs": 256,
        "max_num_batched_tokens": max_num_batched_tokens,
        "max_model_len": max_model_len,
        **(engine_options or {}),
    }
    inst = ModelInstance(engine_config(model, **options), memory=MemoryConfig(0.92))
    fill_normal(inst.kv_cache, 0.5)  # never time on zeros
    return inst, ceilings


SECTIONS = ("attention", "decode", "graphs_vs_eager", "prefill", "mixed")


def run_step_bench(
    model: str,
    out_dir: Path,
    max_model_len: int = 8320,
    sections: tuple[str, ...] = SECTIONS,
    decode_batches: tuple[int, ...] = DECODE_BATCHES,
    decode_contexts: tuple[int, ...] = DECODE_CONTEXTS,
    engine_options: dict | None = None,
    freeze_gc: bool = True,
) -> dict:
    ceilings = measure_ceilings()
    result: dict = {
        "model": model,
        "gpu": torch.cuda.get_device_name(),
        "hbm_copy_tb_per_s": ceilings.hbm_bytes_per_s / 1e12,
        "bf16_tflops": ceilings.bf16_flops_per_s / 1e12,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "step_bench.json"
    if "attention" in sections:
        # Before the engine exists: its KV pool and graphs leave too little memory for the
        # kernel benchmark's own caches.
        result["attention"] = attention_rows(ceilings.hbm_bytes_per_s)
        path.write_text(json.dumps(result, indent=2))
    engine_sections = [name for name in sections if name != "attention"]
    if not engine_sections:
        return result
    nvml_handle = open_nvml()
    sustained = None
    if "decode" in engine_sections:
        # Before the engine takes the GPU's memory, as attention's rows are.
        rates = measure_sustained(nvml_handle=nvml_handle)
        result["sustained"] = {name: rate.as_dict() for name, rate in rates.items()}
        sustained = Ceilings(
            hbm_bytes_per_s=rates["hbm_copy_bytes"].sustained_per_s,
            bf16_flops_per_s=rates["bf16_flops"].sustained_per_s,
        )
        path.write_text(json.dumps(result, indent=2))
    inst, _ = bench_instance(
        model,
        max_model_len,
        ceilings=ceilings,
        engine_options=engine_options,
    )
    bench = StepBench(inst, ceilings, sustained, nvml_handle)
    # As the engine process does once loaded (ember.engine.gc_heap).
    frozen = freeze_startup_heap() if freeze_gc else 0
    result.update(
        gc_frozen_objects=frozen,
        programmatic_launch=inst.ops.programmatic_launch,
        decode_rope_in_attention=inst.config.decode_rope_in_attention,
        defer_norms=inst.model.defers_norms,
        defer_norms_max_rows=inst.ops.defer_norms_max_rows,
        fp8_widen_in_registers=inst.config.fp8_widen_in_registers,
        weight_gib=bench.weight_bytes / 2**30,
        kv_pool_tokens=inst.kv_manager.pool.capacity * inst.kv_manager.block_size,
        load_seconds=inst.load_report.seconds,
        # Of the graphs' capture time at load: eager warm-up passes (first-time kernel
        # compiles and cache loads) and the recording itself.
        graph_warmup_seconds=inst.load_report.graph_warmup_seconds,
        graph_record_seconds=inst.load_report.graph_record_seconds,
        # Before the captures: their kernels compiled on this many threads.
        kernel_compile_seconds=inst.load_report.kernel_compile_seconds,
        compile_workers=inst.load_report.compile_workers,
        # The weights' read, on a thread beside the compile pass.
        weight_load_seconds=inst.load_report.weight_load_seconds,
    )
    measures = {
        "decode": lambda: [
            _row(bench.decode, b, c) for c in decode_contexts for b in decode_batches
        ],
        "graphs_vs_eager": lambda: [_row(bench.eager_vs_graph, b) for b in (1, 64)],
        "prefill": lambda: [_row(bench.prefill, c) for c in PREFILL_CHUNKS],
        "mixed": lambda: [_row(bench.mixed, *case) for case in MIXED_STEPS],
    }
    for name in engine_sections:
        result[name] = measures[name]()
        # Written after every section, so a later failure keeps what was measured.
        path.write_text(json.dumps(result, indent=2))
    if "decode" in result and "prefill" in result:
        _plot(result, out_dir / "step_bench.png")
    return result


def _row(measure, *args) -> dict:
    """One measurement, printed as it lands; an error becomes the row instead of ending the run."""
    try:
        row = measure(*args)
    except Exception as exc:  # noqa: BLE001 - a benchmark row records its failure and goes on
        row = {"args": list(args), "error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(row), flush=True)
    return row


ATTENTION_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ATTENTION_CONTEXTS = (512, 4096)


def attention_rows(
    hbm_bytes_per_s: float,
    batches=ATTENTION_BATCHES,
    contexts=ATTENTION_CONTEXTS,
    preset: str = "llama-3.1-8b",
) -> list[dict]:
    """Decode attention alone, on the launches the engine plans, against the bytes' roofline:
    per (batch, context) of ``preset``'s shape the graph-replayed time (`gpu_seconds`), the
    eager one (with launch overhead), the unsplit time where the plan splits, and the time at
    each split count that leaves a segment 64 keys or more."""
    from triton.testing import do_bench

    from ember.bench.tune import (
        ATTENTION_SPLITS,
        AttentionShape,
        attention_planner,
        decode_attention_bytes,
        decode_attention_step,
    )

    shape = AttentionShape.of(preset)
    planner = attention_planner(shape, torch.device("cuda"))
    rows = []
    for context in contexts:
        for batch in batches:
            run = decode_attention_step(shape, batch, context)
            launches = planner.plan(batch, 1, context)
            seconds = gpu_seconds(partial(run, launches))
            moved = decode_attention_bytes(shape, batch, context, 2)
            splits = launches[0].splits
            row = {
                "batch": batch,
                "context": context,
                "kv_splits": splits,
                "us": seconds * 1e6,
                "eager_us": do_bench(partial(run, launches), return_mode="median") * 1e3,
                "bytes": moved,
                "gb_per_s": moved / seconds / 1e9,
                "roofline_us": moved / hbm_bytes_per_s * 1e6,
                "roofline_fraction": moved / hbm_bytes_per_s / seconds,
            }
            if splits > 1:
                unsplit = planner.plan(batch, 1, context, splits=1)
                row["unsplit_us"] = gpu_seconds(partial(run, unsplit)) * 1e6
            row["us_by_splits"] = {
                n: gpu_seconds(partial(run, planner.plan(batch, 1, context, splits=n))) * 1e6
                for n in ATTENTION_SPLITS
                if n * 64 <= context
            }
            rows.append(row)
            del run
    torch.cuda.empty_cache()
    return rows


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for context in DECODE_CONTEXTS:
        rows = [r for r in result["decode"] if r.get("context") == context and "step_ms" in r]
        axes[0].plot(
            [r["batch"] for r in rows],
            [r["step_ms"] for r in rows],
            "o-",
            label=f"measured, ctx {context}",
        )
        axes[0].plot(
            [r["batch"] for r in rows],
            [r["roofline_ms"] for r in rows],
            "x--",
            label=f"roofline, ctx {context}",
        )
    axes[0].set(xscale="log", xlabel="batch", ylabel="decode step (ms)", title="Decode step")
    axes[0].legend()
    rows = [r for r in result["prefill"] if "step_ms" in r]
    axes[1].plot([r["chunk"] for r in rows], [r["fraction_of_bf16_peak"] for r in rows], "o-")
    axes[1].set(
        xscale="log",
        xlabel="prefill chunk (tokens)",
        ylabel="fraction of bf16 peak",
        title="Prefill",
        ylim=(0, 1),
    )
    fig.suptitle(f"{result['gpu']}: {result['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        help="checkpoint directory (see make-model; with --load-format dummy, its config.json)",
    )
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    # Room for the largest prefill chunk (8,192) plus a margin.
    parser.add_argument("--max-model-len", type=int, default=8320)
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=SECTIONS,
        default=list(SECTIONS),
        help="what to measure (default: all)",
    )
    parser.add_argument("--decode-batches", type=int, nargs="+", default=list(DECODE_BATCHES))
    parser.add_argument("--decode-contexts", type=int, nargs="+", default=list(DECODE_CONTEXTS))
    cli.add_fast_path_arguments(parser)
    cli.add_load_arguments(parser)
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        help="auto (the model's dtype, the default) or fp8: an FP8 KV cache, whose decode "
        "steps read half the KV bytes",
    )
    parser.add_argument(
        "--no-gc-freeze",
        action="store_true",
        help="leave the loaded heap in the garbage collector's passes (the "
        "engine process freezes it)",
    )


def run(args: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("ember bench step needs a CUDA GPU")
        return 2
    if (args.tensor_parallel_size or 1) > 1 and "graphs_vs_eager" in args.sections:
        # Its eager runner is a second runner on rank 0 alone, which the other ranks never
        # join (and no graphs are captured past one GPU yet).
        print("ember bench step: graphs_vs_eager runs on one GPU only (leave out -tp)")
        return 2
    run_step_bench(
        args.model,
        args.out,
        args.max_model_len,
        tuple(args.sections),
        tuple(args.decode_batches),
        tuple(args.decode_contexts),
        cli.engine_options(args),
        freeze_gc=not args.no_gc_freeze,
    )
    return 0
