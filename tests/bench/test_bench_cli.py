"""The benchmark commands that run without a GPU."""

from __future__ import annotations

import json

import pytest
import torch

from ember import LLM, SamplingParams
from ember.bench import cpu_step
from ember.cli import main

pytestmark = pytest.mark.slow  # the benchmarks' tooling: whole runs, not the engine


def test_make_model_writes_a_loadable_checkpoint(tmp_path):
    out = tmp_path / "tiny"
    assert (
        main(["bench", "make-model", "--preset", "tiny", "--out", str(out), "--device", "cpu"]) == 0
    )
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "model.layers.3.mlp.down_proj.weight" in index["weight_map"]
    llm = LLM(str(out), max_model_len=128)
    tokens = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0]
    assert len(tokens.token_ids) == 4


def test_make_model_writes_fp8_weights_in_the_compressed_tensors_layout(tmp_path):
    """As llm-compressor's FP8_DYNAMIC: each decoder projection in float8 e4m3 with a bf16 scale
    per output row, the embeddings in bf16; ember loads it as an FP8 checkpoint, and the step
    benchmark's roofline reads its projections at one byte an element."""
    from safetensors.torch import load_file

    from ember.bench.roofline import Ceilings
    from ember.bench.step_bench import StepBench
    from ember.config import engine_config
    from ember.engine.model_instance import ModelInstance

    paths = {}
    for form, flags in (("bf16", []), ("fp8", ["--quantization", "fp8"])):
        paths[form] = tmp_path / form
        argv = ["bench", "make-model", "--preset", "tiny", "--out", str(paths[form])]
        assert main([*argv, "--device", "cpu", *flags]) == 0
    config = json.loads((paths["fp8"] / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["ignore"] == ["lm_head"]
    weights = load_file(str(paths["fp8"] / "model-00001-of-00001.safetensors"))
    plain = load_file(str(paths["bf16"] / "model-00001-of-00001.safetensors"))
    name = "model.layers.2.mlp.down_proj"
    weight, scale = weights[f"{name}.weight"], weights[f"{name}.weight_scale"]
    assert weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.bfloat16
    assert scale.shape == (weight.shape[0], 1)
    assert weights["model.embed_tokens.weight"].dtype == torch.bfloat16
    dequantized = weight.float() * scale.float()
    # e4m3 keeps 3 bits (rounded to half a step, 2**-4 of a value), and subnormal steps of
    # 2**-9 of a row's scale.
    subnormal_step = float(scale.max()) * 2**-9
    expected = plain[f"{name}.weight"].float()
    torch.testing.assert_close(dequantized, expected, atol=subnormal_step, rtol=2**-4)
    benches = {}
    for form, path in paths.items():
        options = {"device": "cpu", "max_model_len": 128, "num_gpu_blocks_override": 16}
        instance = ModelInstance(engine_config(str(path), **options))
        benches[form] = StepBench(instance, Ceilings(hbm_bytes_per_s=1e11, bf16_flops_per_s=1e12))
    fp8_model = benches["fp8"].inst.model
    assert fp8_model.cfg.fp8 is not None and fp8_model.cfg.fp8.from_checkpoint
    assert benches["fp8"].matmul_params == benches["bf16"].matmul_params
    linear = sum(p.numel() for n, p in fp8_model.named_parameters() if n.endswith("_proj.weight"))
    rows = sum(p.numel() for n, p in fp8_model.named_parameters() if n.endswith("weight_scale"))
    # On the CPU the model runs in float32: each projection weight saves three bytes an element.
    assert benches["bf16"].weight_bytes - benches["fp8"].weight_bytes == 3 * linear - 4 * rows


def test_structured_output_bench_compares_both_modes_on_the_tiny_preset(tmp_path, capsys):
    out = tmp_path / "structured.json"
    args = ["--preset", "tiny", "--device", "cpu", "--batches", "1,3", "--max-tokens", "6"]
    args += ["--prompt-len", "8", "--repeats", "1", "--out", str(out)]
    assert main(["bench", "structured-output", *args]) == 0
    result = json.loads(out.read_text())
    assert [(row["batch"], row["mode"]) for row in result["rows"]] == [
        (1, "none"),
        (1, "json"),
        (3, "none"),
        (3, "json"),
    ]
    none, constrained = result["rows"][2:]
    assert none["output_tokens"] == constrained["output_tokens"] == 3 * 5  # after the first
    assert constrained["mask_fill_ms_per_step"] > 0 and "overhead_vs_none" in constrained
    assert result["grammar_tokenizer_s"] > 0 and "us/token" in capsys.readouterr().out


def test_cpu_step_reports_every_phase():
    row = cpu_step.measure(batch=8, context=64, steps=5)
    assert row["batch"] == 8
    phases = ("schedule_ms", "launch_ms", "collect_ms", "update_ms")
    assert all(row[key] > 0 for key in phases) and "wait_ms" not in row
    assert abs(row["total_ms"] - sum(row[key] for key in phases)) < 1e-9
    assert row["gc"]["gen2_collections"] >= 0 and row["gc"]["gc_ms_per_step"] >= 0


def test_cpu_step_decodes_every_request_on_the_stand_in_model():
    """The stand-in model feeds the engine's own scheduler and runner: every request gets one
    token a step, and the pool is whole again once they finish."""
    from ember.config import StepLimits
    from ember.engine.request import Request
    from ember.sampling_params import SamplingParams

    loop = cpu_step.null_model_loop(StepLimits(4, 64, 128), num_blocks=32)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    requests = [Request(f"r{i}", list(range(1, 20 + i)), params, i, 5) for i in range(6)]
    for request in requests:
        loop.scheduler.add_request(request)
    while loop.has_work():
        loop.step()
    assert all(r.output_token_ids == [0] * 5 and r.is_finished for r in requests)
    loop.scheduler.check_invariants()


@pytest.mark.parametrize(
    "argv",
    [
        ["step", "--model", "unused"],
        ["profile", "--model", "unused"],
        ["tune"],
        ["tune", "--weight-dtype", "fp8", "--kv-cache-dtype", "fp8", "--merge-into", "t.json"],
    ],
)
def test_gpu_benchmarks_refuse_without_a_gpu(capsys, argv):
    if torch.cuda.is_available():
        return
    assert main(["bench", *argv]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


@pytest.fixture
def tiny_bench(tiny_bench_factory):
    """A StepBench over the tiny preset on the CPU, with made-up ceilings."""
    from ember.bench.roofline import Ceilings

    return tiny_bench_factory(Ceilings(hbm_bytes_per_s=1e11, bf16_flops_per_s=1e12))


def test_step_bench_logic_runs_on_a_cpu(tiny_bench):
    """The GPU step benchmark's bookkeeping (warm requests, drains, roofline maths) on a tiny
    model on the CPU, so a device run is not the first time this code executes."""
    bench, inst = tiny_bench, tiny_bench.inst
    row = bench.decode(batch=2, context=32, steps=3, warmup=1)
    assert row["step_ms"] > 0 and 0 < row["fraction_of_roofline"]
    assert row["sequential_roofline_ms"] >= row["roofline_ms"] * (1 - 1e-9)
    assert row["gpu_only_ms"] is None  # no graphs on a CPU
    host = row["host_ms_per_step"]
    assert set(host) == {"schedule", "launch", "wait", "collect", "update"}
    assert min(host["schedule"], host["launch"], host["collect"], host["update"]) > 0
    assert host["wait"] == 0  # a CPU step has no event to wait on
    assert sum(host.values()) <= row["step_ms"] * 1.05
    assert set(row["gc"]) == {
        "gc_ms_per_step",
        "gen2_collections",
        "gen2_pause_ms",
        "max_pause_ms",
        "slow_passes",
    }
    assert all(p["pause_ms"] > 20 for p in row["gc"]["slow_passes"])  # gc_heap.SLOW_PASS_S
    assert bench.decode(batch=4, context=250)["skipped"].startswith("KV for")
    assert "chosen_experts_roofline_ms" not in row  # a dense model
    prefill = bench.prefill(chunk=16, repeat=1)
    assert prefill["tokens_per_s"] > 0
    eager = bench.eager_vs_graph(batch=2, context=32)
    assert eager["eager_step_ms"] > 0
    assert bench.loop.runner is inst.runner  # back on the instance's runner
    mixed = bench.mixed(batch=2, context=32, chunk=20, steps=3, warmup=1)
    assert mixed["step_ms"] > 0 and mixed["prompts"] == 4
    # Every prompt went through its prefill beside the decodes (the last may be in flight).
    assert mixed["prompts_prefilled"] >= 3
    assert bench.mixed(batch=4, context=250, chunk=20)["skipped"].startswith("KV for")
    inst.scheduler.check_invariants()
    assert inst.kv_manager.num_free_blocks == inst.kv_manager.pool.capacity


def _arrivals(seed: int = 0) -> list[tuple[int, list[int], int]]:
    """(the step before which it arrives, prompt, max_tokens) of eight greedy requests: more than
    the tiny bench's four slots, prompts longer than its 64-token step, some arriving late."""
    g = torch.Generator().manual_seed(seed)
    lengths = [5, 70, 12, 33, 9, 90, 17, 40]
    return [
        (0 if i < 5 else 3, torch.randint(3, 4000, (n,), generator=g).tolist(), 3 + i % 5)
        for i, n in enumerate(lengths)
    ]


def _trace(inst, step, has_work, prefix: str) -> list[list[tuple]]:
    """Each step's updates (request, new tokens, finish reason) over the `_arrivals` workload."""
    steps: list[list[tuple]] = []
    arrivals = dict(enumerate(_arrivals()))
    while arrivals or has_work():
        for i, (at, prompt, max_tokens) in list(arrivals.items()):
            if at == len(steps):
                params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                inst.add_request(f"{prefix}{i}", prompt, params)
                del arrivals[i]
        updates = step()
        steps.append([(u.request_id[1:], u.new_token_ids, u.finish_reason) for u in updates])
    return steps


@pytest.mark.parametrize("overlap", [False, True])
def test_bench_loop_steps_as_the_instance_does(tiny_bench_factory, overlap):
    """The step bench's loop (the instance's public calls, each timed) yields, step by step, the
    updates `ModelInstance.step` yields, with and without overlap."""
    from ember.bench.host_phases import TimedLoop
    from ember.bench.roofline import Ceilings

    # The second pass sends the first's prompts: a prefix cache would give it other steps.
    bench = tiny_bench_factory(Ceilings(1e11, 1e12), overlap=overlap, enable_prefix_caching=False)
    inst = bench.inst
    by_instance = _trace(inst, inst.step, inst.has_work, "i")
    loop = TimedLoop.of(inst)
    by_loop = _trace(inst, loop.step, loop.has_work, "l")
    assert by_loop == by_instance
    tokens = [u for step in by_loop for u in step]
    assert len(tokens) == sum(n for _, _, n in _arrivals())  # every token came back, once
    assert sum(reason == "length" for _, _, reason in tokens) == len(_arrivals())
    assert min(loop.seconds.values()) >= 0 and loop.seconds["launch"] > 0
    inst.scheduler.check_invariants()


def test_step_bench_row_records_an_error_and_the_plot_skips_it(tmp_path, capsys):
    from ember.bench.step_bench import _plot, _row

    def failing(batch, context):
        raise MemoryError("KV pool exhausted")

    row = _row(failing, 256, 4096)
    assert row == {"args": [256, 4096], "error": "MemoryError: KV pool exhausted"}
    assert "KV pool exhausted" in capsys.readouterr().out
    good = {"batch": 1, "context": 512, "step_ms": 5.0, "roofline_ms": 4.0}
    prefill = {"chunk": 512, "step_ms": 9.0, "fraction_of_bf16_peak": 0.5}
    result = {"gpu": "cpu", "model": "tiny", "decode": [good, row], "prefill": [prefill, row]}
    _plot(result, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_make_model_output_rows_past_the_tokenizer_are_zero(tmp_path, monkeypatch):
    """A preset wider than the tokenizer (Llama 3's 128k ids) must still decode greedily to ids
    the tokenizer has, or a serving benchmark would stream tokens without text."""
    from safetensors.torch import load_file

    from ember.bench import make_model as mm

    wide = {**mm.PRESETS["tiny"], "vocab_size": mm.TOKENIZER_VOCAB + 512}
    wide["tie_word_embeddings"] = False
    monkeypatch.setitem(mm.PRESETS, "wide", wide)
    out = mm.make_model("wide", tmp_path / "wide", device="cpu")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shard = load_file(str(out / index["weight_map"]["lm_head.weight"]))
    lm_head = shard["lm_head.weight"]
    assert lm_head.shape[0] == mm.TOKENIZER_VOCAB + 512
    assert not lm_head[mm.TOKENIZER_VOCAB :].any() and lm_head[: mm.TOKENIZER_VOCAB].any()
    llm = LLM(str(out), max_model_len=128)
    outs = llm.generate(["hello", "a b c"], SamplingParams(temperature=0, max_tokens=8))
    assert all(t < mm.TOKENIZER_VOCAB for o in outs for t in o.outputs[0].token_ids)


def test_profile_splits_kernels_by_what_they_follow():
    from ember.bench.step_profile import by_predecessor

    # Two steps of: norm, gemm (q/k/v), attention, gemm (o); times in us.
    one_step = [("norm", 0, 2), ("gemm", 3, 13), ("attn", 14, 20), ("gemm", 22, 30)]
    spans = one_step + [(name, start + 100, end + 100) for name, start, end in one_step]
    rows = {(r["after"], r["kernel"]): r for r in by_predecessor(spans, num_steps=2)}
    after_norm, after_attention = rows[("norm", "gemm")], rows[("attn", "gemm")]
    assert after_norm["launches_per_step"] == 1 and after_norm["us_each"] == 10
    assert after_norm["gap_us_each"] == 1
    assert after_attention["us_each"] == 8 and after_attention["gap_us_each"] == 2
    # The second step's first kernel follows the first step's last: 70 us of gap.
    assert rows[("gemm", "norm")]["launches_per_step"] == 0.5
    assert rows[("gemm", "norm")]["gap_us_each"] == 70
    assert [r["us_per_step"] for r in by_predecessor(spans, 2)] == sorted(
        (r["us_per_step"] for r in rows.values()), reverse=True
    )


def test_profile_groups_kernels_by_category():
    from ember.bench.step_profile import categorize, summarize_kernels

    assert categorize("_paged_attention_kernel") == "attention"
    assert categorize("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64") == "gemm"
    assert categorize("nvjet_tst_128x64_64x8_1x1_v_bz_TNT") == "gemm"
    assert categorize("_fused_add_rms_norm_kernel") == "norm"
    assert categorize("_rope_and_cache_write_kernel") == "rope_kv_write"
    assert categorize("Memcpy DtoH (Device -> Pinned)") == "copy"
    for moe in ("_gate_up_kernel", "_down_kernel", "_align_kernel", "_route_kernel"):
        assert categorize(moe) == "moe"
    assert categorize("something_else") == "other"
    events = [("nvjet_gemm", 30.0), ("nvjet_gemm", 30.0), ("_paged_attention_kernel", 10.0)] * 2
    summary = summarize_kernels(events, num_steps=2)
    assert summary["gpu_us_per_step"] == 70.0
    assert summary["categories_us_per_step"] == {"gemm": 60.0, "attention": 10.0}
    top = summary["top_kernels"][0]
    assert top["name"] == "nvjet_gemm" and top["launches_per_step"] == 2


def test_critical_path_counts_what_each_kernel_adds():
    from ember.bench.step_profile import critical_path_us

    spans = [
        ("nvjet_gemm", 0.0, 10.0),
        ("_rms_norm_kernel", 2.0, 12.0),  # launched early (PDL): adds only 2 us past the GEMM
        ("_paged_attention_kernel", 20.0, 25.0),  # after an idle gap: adds its own 5 us
    ]
    assert critical_path_us(spans, num_steps=1) == {"gemm": 10.0, "attention": 5.0, "norm": 2.0}


def test_critical_path_by_role_tells_one_kernels_roles_apart():
    from ember.bench.step_profile import critical_path_by_role

    # Two layers of: gemm (q/k/v), attn, gemm (o), gemm (gate/up), gemm (down); each kernel
    # launched early (PDL) except o, which starts 1 us after attention ends.
    layer = [("gemm", 0, 10), ("attn", 8, 14), ("gemm", 15, 20), ("gemm", 18, 50), ("gemm", 45, 60)]
    spans = layer + [(name, start + 60, end + 60) for name, start, end in layer]
    rows = critical_path_by_role(spans, num_steps=1)
    by_role = {(tuple(r["before"]), r["kernel"], r["next"]): r for r in rows}
    assert by_role[(("gemm", "gemm"), "gemm", "attn")]["critical_us_each"] == 10  # 2nd q/k/v
    assert by_role[(("gemm", "attn"), "gemm", "gemm")]["critical_us_each"] == 5  # o: 15-20
    attention = by_role[(("gemm", "gemm"), "attn", "gemm")]
    assert attention["critical_us_each"] == 4  # 8-14, past q/k/v's end at 10
    assert by_role[(("attn", "gemm"), "gemm", "gemm")]["critical_us_per_step"] == 60  # gate/up
    assert by_role[(("gemm", "gemm"), "gemm", "")]["critical_us_each"] == 10  # the last down
    assert sum(r["critical_us_per_step"] for r in rows) == 118  # busy 0-120 less two 1 us gaps
    assert [r["critical_us_per_step"] for r in rows] == sorted(
        (r["critical_us_per_step"] for r in rows), reverse=True
    )


def test_profile_logic_runs_on_a_cpu(tiny_bench, tmp_path):
    """The profiler benchmark's request bookkeeping on a tiny model (no CUDA kernels to count)."""
    from ember.bench.step_profile import profile_decode, profile_mixed

    bench, inst = tiny_bench, tiny_bench.inst
    trace = tmp_path / "trace.json"
    decode = profile_decode(bench, batch=2, context=16, steps=2, trace=trace)
    assert decode["wall_us_per_step"] > 0 and trace.stat().st_size > 0
    mixed = profile_mixed(bench, batch=2, context=16, chunk=24, trace=None)
    assert mixed["kind"] == "mixed" and mixed["prefill_tokens"] == 24
    assert inst.kv_manager.num_free_blocks == inst.kv_manager.pool.capacity
    # A batch that fills every slot would profile a decode-only step under the mixed label.
    full = inst.limits.max_num_seqs
    with pytest.raises(ValueError, match="needs a slot"):
        profile_mixed(bench, batch=full, context=16, chunk=24, trace=None)


def test_load_format_dummy_reaches_the_benchmarks_models():
    """`ember bench step` and `profile` load with it (and with --quantization fp8); `serve`
    passes it to the server it launches."""
    import argparse

    from ember.bench import serve, step_bench
    from ember.cli import engine_options

    parser = argparse.ArgumentParser()
    step_bench.add_arguments(parser)
    args = parser.parse_args(["--model", "m", "--load-format", "dummy", "--quantization", "fp8"])
    options = engine_options(args)
    assert (options["load_format"], options["quantization"]) == ("dummy", "fp8")
    parser = argparse.ArgumentParser()
    serve.add_serve_bench_arguments(parser)
    argv = ["--launch", "m", "--server-args=--seed 3", "--load-format", "dummy"]
    spec = serve.launch_spec(parser.parse_args(argv))
    assert spec.model == "m" and spec.server_args == ("--seed", "3", "--load-format", "dummy")
    assert serve.launch_spec(parser.parse_args(argv[:3])).server_args == ("--seed", "3")


def test_expected_chosen_experts_counts_distinct_experts_of_uniform_routing():
    from ember.bench.step_bench import expected_chosen_experts

    assert expected_chosen_experts(128, 8, 1) == pytest.approx(8)  # one token: its own k
    assert expected_chosen_experts(8, 8, 5) == pytest.approx(8)  # k = E: every expert
    gen = torch.Generator().manual_seed(0)
    counts = [
        len({int(e) for _ in range(16) for e in torch.randperm(32, generator=gen)[:4]})
        for _ in range(400)
    ]
    assert sum(counts) / len(counts) == pytest.approx(expected_chosen_experts(32, 4, 16), rel=0.02)


def test_a_moe_decode_row_has_a_floor_for_its_chosen_experts(tmp_path):
    """A decode step of a mixture of experts gets a second floor, reading only the experts its
    tokens choose; a dense model's row has none."""
    from ember.bench.make_model import make_model
    from ember.bench.roofline import Ceilings
    from ember.bench.step_bench import StepBench, expected_chosen_experts
    from ember.config import engine_config
    from ember.engine.model_instance import ModelInstance

    path = make_model("tiny-qwen3-moe", tmp_path / "moe", device="cpu")
    config = engine_config(
        str(path), device="cpu", num_gpu_blocks_override=64, max_num_seqs=4,
        max_num_batched_tokens=64, max_model_len=256,
    )  # fmt: skip
    ceilings = Ceilings(hbm_bytes_per_s=1e11, bf16_flops_per_s=1e12)
    bench = StepBench(ModelInstance(config), ceilings, None, None)
    cfg = bench.cfg
    assert 0 < bench.expert_bytes < bench.weight_bytes
    row = bench.decode(batch=2, context=32, steps=2, warmup=1)
    chosen = expected_chosen_experts(cfg.num_experts, cfg.num_experts_per_tok, 2)
    assert row["expected_chosen_experts"] == pytest.approx(chosen)
    assert row["chosen_experts_roofline_ms"] < row["sequential_roofline_ms"]
    skipped = bench.expert_bytes * (1 - chosen / cfg.num_experts)
    assert row["sequential_roofline_ms"] - row["chosen_experts_roofline_ms"] == pytest.approx(
        skipped / 1e11 * 1e3, rel=1e-6
    )
    # Each token multiplies by its top-k experts only, not by all of them.
    sparse = sum(cfg.is_moe_layer(layer) for layer in range(cfg.num_layers))
    experts = sparse * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    per_token = bench.matmul_params - experts * (1 - cfg.num_experts_per_tok / cfg.num_experts)
    assert bench.token_matmul_params == per_token < bench.matmul_params
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * 2 * (32 + 1 + 2 / 2)
    assert row["flops"] == pytest.approx(2 * per_token * 2 + attention, rel=1e-9)


def test_the_chosen_experts_floor_counts_packed_mxfp4_bytes(tmp_path):
    """gpt-oss with MXFP4 experts: the step benchmark multiplies as many weights as with bf16
    ones, and reads each expert at its packed half byte a value and a scale byte a 32."""
    from ember.bench.make_model import make_model
    from ember.bench.roofline import Ceilings
    from ember.bench.step_bench import StepBench
    from ember.config import engine_config
    from ember.engine.model_instance import ModelInstance

    benches = {}
    for form in (None, "mxfp4"):
        path = make_model("tiny-gpt-oss", tmp_path / str(form), device="cpu", quantization=form)
        config = engine_config(
            str(path), device="cpu", num_gpu_blocks_override=64, max_model_len=256
        )
        ceilings = Ceilings(hbm_bytes_per_s=1e11, bf16_flops_per_s=1e12)
        benches[form] = StepBench(ModelInstance(config), ceilings, None, None)
    plain, packed = benches[None], benches["mxfp4"]
    assert packed.matmul_params == plain.matmul_params
    cfg = packed.cfg
    values = cfg.num_layers * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    biases = cfg.num_layers * cfg.num_experts * (2 * cfg.moe_intermediate_size + cfg.hidden_size)
    assert plain.expert_bytes == 4 * (values + biases)  # float32 on the CPU
    assert packed.expert_bytes == values * 17 // 32 + 4 * biases
    assert plain.weight_bytes - packed.weight_bytes == plain.expert_bytes - packed.expert_bytes


def test_warm_requests_hold_only_their_windows_in_a_windowed_layers_pool(tmp_path):
    """gpt-oss's windowed layers in their own pool, sized for 4 running windows: the step
    benchmark's warm requests of 400 tokens fit, as the scheduler would keep them (a chunk at a
    time, what the window passed given back), where their whole tables would not."""
    from ember.bench.make_model import make_model
    from ember.bench.roofline import Ceilings
    from ember.bench.step_bench import StepBench
    from ember.config import engine_config
    from ember.engine.model_instance import ModelInstance

    path = make_model("tiny-gpt-oss", tmp_path / "gpt-oss", device="cpu")
    config = engine_config(
        str(path), device="cpu", num_gpu_blocks_override=200, max_model_len=512, max_num_seqs=4,
        max_num_batched_tokens=64,
    )  # fmt: skip
    bench = StepBench(ModelInstance(config), Ceilings(1e11, 1e12), None, None)
    kv = bench.inst.kv_manager
    assert kv.local_pool.capacity < 4 * 400 // kv.block_size < kv.pool.capacity
    row = bench.decode(batch=4, context=400, steps=2, warmup=1)
    assert row["step_ms"] > 0
    assert bench.eager_vs_graph(batch=2, context=300)["eager_step_ms"] > 0  # its own runner
    bench.inst.scheduler.check_invariants()
    assert kv.local_pool.num_free == kv.local_pool.capacity


def test_the_chosen_experts_floor_counts_fp8_llama4_experts_at_a_byte(tmp_path):
    """Llama 4 on dummy weights, FP8 (make-model's config, as the Scout benchmark runs it)
    against bf16's config: the same weights multiplied; the routed experts read at a byte a
    weight and four a row scale; the shared expert and the router are read by every step."""
    from ember.bench.make_model import make_model
    from ember.bench.roofline import Ceilings
    from ember.bench.step_bench import StepBench
    from ember.config import engine_config
    from ember.engine.model_instance import ModelInstance

    benches = {}
    for form in (None, "fp8"):
        path = make_model("tiny-llama4", tmp_path / str(form), quantization=form, config_only=True)
        config = engine_config(
            str(path), device="cpu", load_format="dummy", num_gpu_blocks_override=64,
            max_model_len=256,
        )  # fmt: skip
        ceilings = Ceilings(hbm_bytes_per_s=1e11, bf16_flops_per_s=1e12)
        benches[form] = StepBench(ModelInstance(config), ceilings, None, None)
    plain, fp8 = benches[None], benches["fp8"]
    assert fp8.matmul_params == plain.matmul_params
    cfg = fp8.cfg
    sparse = sum(cfg.is_moe_layer(layer) for layer in range(cfg.num_layers))
    values = sparse * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    rows = sparse * cfg.num_experts * (2 * cfg.moe_intermediate_size + cfg.hidden_size)
    assert plain.expert_bytes == 4 * values  # float32 on the CPU
    assert fp8.expert_bytes == values + 4 * rows  # the shared expert not among them
