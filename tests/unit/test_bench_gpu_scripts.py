"""The fast-path GPU benchmarks (bench/offline_throughput.py with its FP8 variants, bench/ttft.py): their floor
arithmetic on hand-computed numbers, and both scripts end to end in --smoke mode (CPU, tiny model) checking the
JSON they write. The GPU runs themselves happen on the GPU machine; these keep the scripts correct until then."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import offline_throughput, offline_variants, prompt_scoring, ttft
from bench.floors import ModelCost, throughput_floor
from bench.harness import DeviceRates
from bench.ttft import ttft_floor
from model_runtime.config import ModelConfig
from model_runtime.weights import load_model_config, resolve_model

pytestmark = pytest.mark.unit

# 2 layers, hidden 8, 2 query heads over 1 KV head of dim 4, intermediate 16, vocab 10, untied head.
TOY = ModelConfig(
    architecture="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2,
    num_kv_heads=1, head_dim=4, max_position_embeddings=64,
)  # fmt: skip
ONE_BYTE_TEN_FLOPS = DeviceRates(hbm_gbps=1e-9, matmul_tflops=1e-11)  # 1 byte/s, 10 FLOP/s


def test_model_cost_of_a_toy_shape_by_hand():
    cost = ModelCost.from_config(TOY, dtype_bytes=2)
    # per layer: q,k,v 8 x (8 + 4 + 4) = 128, o 8 x 8 = 64, gate/up/down 3 x 8 x 16 = 384 -> 576; two layers
    assert cost.layer_matmul_params == 1152
    assert cost.head_params == 80
    # param_count 1352 (adds norms 2 x 2 x 8 + final 8 and embedding 80) less the embedding, x 2 bytes
    assert cost.weight_bytes_read == (1352 - 80) * 2 == 2544
    assert cost.kv_bytes_per_token == 2 * 2 * 4 * 2  # K and V, 2 layers, 1 KV head x dim 4, 2 bytes
    assert cost.attn_flops_per_key == 4 * 2 * 2 * 4
    # prompt of 4: linear 2 x 1152 x 4 = 9216, one logits row 2 x 80 = 160, causal keys 1+2+3+4 = 10 x 64
    assert cost.prefill_flops(4) == 9216 + 160 + 640
    # 3 sequences at context 6: 3 x (2 x (1152 + 80) + 64 x 6); bytes: weights + 3 x 6 x 32 of KV
    assert cost.decode_step_flops(3, 6) == 3 * (2464 + 384) == 8544
    assert cost.decode_step_bytes(3, 6) == 2544 + 576
    tied = ModelCost.from_config(dataclasses.replace(TOY, tie_word_embeddings=True), dtype_bytes=2)
    assert tied.weight_bytes_read == (1352 - 80) * 2  # tied: one table, read as the head


def test_model_cost_with_fp8_weights_and_kv_by_hand():
    fp8 = ModelCost.from_config(TOY, dtype_bytes=2, fp8_weights=True, fp8_kv=True)
    # the 1152 projection weights at 1 byte instead of 2, plus a 4-byte scale per output row: q 8, k 4, v 4,
    # o 8, gate 16, up 16, down 8 = 64 a layer, 128 in all; norms and the head keep 2 bytes
    assert fp8.weight_bytes_read == 2544 - 1152 + 128 * 4 == 1904
    assert fp8.kv_bytes_per_token == 2 * 2 * (4 * 1 + 2)  # K and V, 2 layers: 4 codes and a bf16 scale
    bf16 = ModelCost.from_config(TOY, dtype_bytes=2)
    assert (fp8.layer_matmul_params, fp8.head_params, fp8.attn_flops_per_key) == (1152, 80, 64)  # same FLOPs
    assert fp8.decode_step_flops(3, 6) == bf16.decode_step_flops(3, 6)
    weights_only = ModelCost.from_config(TOY, dtype_bytes=2, fp8_weights=True)
    assert (weights_only.weight_bytes_read, weights_only.kv_bytes_per_token) == (
        1904,
        bf16.kv_bytes_per_token,
    )
    kv_only = ModelCost.from_config(TOY, dtype_bytes=2, fp8_kv=True)
    assert (kv_only.weight_bytes_read, kv_only.kv_bytes_per_token) == (2544, 24)


def test_step_floor_takes_the_slower_of_flops_and_bytes():
    assert DeviceRates(1e-9, 1e-12).step_floor_s(8544, 3120) == pytest.approx(8544)  # 1 FLOP/s: compute
    assert ONE_BYTE_TEN_FLOPS.step_floor_s(8544, 3120) == pytest.approx(3120)  # 10 FLOP/s: memory


def test_throughput_floor_by_hand():
    cost = ModelCost.from_config(TOY, dtype_bytes=2)
    floor = throughput_floor(cost, ONE_BYTE_TEN_FLOPS, num_prompts=5, input_len=4, output_len=5, batch=3)
    assert floor.prefill_s == pytest.approx(5 * 10016 / 10)
    # waves of 3 and 2, each 4 decode steps at mean context 4 + 5/2 = 6.5, both memory-bound at 1 byte/s:
    # 3 seqs: 2544 + 3 x 6.5 x 32 = 3168 bytes (vs 864 s of FLOPs); 2 seqs: 2544 + 416 = 2960 bytes
    assert floor.decode_s == pytest.approx(4 * 3168 + 4 * 2960)
    assert floor.decode_bytes == 4 * 3168 + 4 * 2960  # memory-bound at 1 byte/s: the seconds are the bytes
    assert floor.output_tokens == 25
    assert floor.tokens_per_s == pytest.approx(25 / (5008 + 24512))
    one_token = throughput_floor(cost, ONE_BYTE_TEN_FLOPS, num_prompts=5, input_len=4, output_len=1, batch=8)
    assert one_token.decode_s == 0  # the only token comes from prefill
    with pytest.raises(ValueError, match="batch"):
        throughput_floor(cost, ONE_BYTE_TEN_FLOPS, num_prompts=5, input_len=4, output_len=5, batch=0)


def test_fp8_projection_flops_count_at_the_fp8_rate_by_hand():
    """FP8 weights: the projections' FLOPs at the FP8 matmul rate, attention's and lm_head's at the model
    dtype's; an unmeasured FP8 rate (0) counts them at the model dtype's."""
    fp8, bf16 = ModelCost.from_config(TOY, 2, fp8_weights=True), ModelCost.from_config(TOY, 2)
    assert fp8.fp8_projections and not bf16.fp8_projections
    rates = DeviceRates(hbm_gbps=1e-9, matmul_tflops=1e-11, fp8_matmul_tflops=4e-11)  # 10 and 40 FLOP/s
    # prompt of 4: projections 2 x 1152 x 4 = 9216 at 40/s, logits row 160 + attention 640 at 10/s
    assert fp8.compute_s(rates, fp8.prefill_flops(4), 4) == pytest.approx(9216 / 40 + 800 / 10)
    assert bf16.compute_s(rates, bf16.prefill_flops(4), 4) == pytest.approx(10016 / 10)
    assert fp8.compute_s(ONE_BYTE_TEN_FLOPS, fp8.prefill_flops(4), 4) == pytest.approx(1001.6)  # unmeasured
    floor = throughput_floor(fp8, rates, num_prompts=5, input_len=4, output_len=5, batch=3)
    assert floor.prefill_s == pytest.approx(5 * (9216 / 40 + 800 / 10))
    # decode still memory-bound at 1 byte/s: 3 seqs 1904 + 3 x 6.5 x 32, 2 seqs 1904 + 2 x 6.5 x 32
    assert floor.decode_s == pytest.approx(4 * (1904 + 624) + 4 * (1904 + 416))
    slow_hbm = DeviceRates(hbm_gbps=1e-12, matmul_tflops=1e-11, fp8_matmul_tflops=4e-11)  # 0.001 byte/s
    step = fp8.compute_s(slow_hbm, fp8.decode_step_flops(3, 6), 3)  # 3 x 2 x 1152 at 40/s, the rest at 10/s
    assert step == pytest.approx(6912 / 40 + (8544 - 6912) / 10)
    assert ttft_floor(fp8, rates, prompt_len=4).flop_s == pytest.approx(9216 / 40 + 80)


def test_ttft_floor_by_hand_and_the_8b_numbers():
    floor = ttft_floor(ModelCost.from_config(TOY, 2), ONE_BYTE_TEN_FLOPS, prompt_len=4)
    assert floor.flops == 10016 and floor.flop_s == pytest.approx(1001.6)
    assert floor.weight_read_s == pytest.approx(2544) and floor.floor_s == pytest.approx(2544)
    llama = ModelCost.from_config(load_model_config(resolve_model("dummy:llama-3-8b")), dtype_bytes=2)
    assert (
        llama.weight_bytes_read == 15_009_849_344
    )  # what bench/decode_step.py counted from the real tensors
    assert llama.kv_bytes_per_token == 128 * 1024
    # 2k prompt: 2 x 6,979,321,856 x 2048 + 2 x 525,336,576 + 524,288 x 2048 x 2049 / 2
    assert llama.prefill_flops(2048) == 29_688_401_494_016


# --- the scripts in --smoke mode ------------------------------------------------------------------------
def _smoke_argv(model: str, out: Path) -> list[str]:
    """offline_throughput --smoke on the tiny model: two toy shapes, 6 and 3 prompts, the JSON at `out`."""
    return ["--smoke", "--model", model, "--out", str(out), "--shapes", "16/8,24/4", "--num-prompts", "6,3"]


def test_offline_throughput_smoke_counts_every_token(tiny_model, tmp_path):
    out = tmp_path / "offline.json"
    argv = _smoke_argv(tiny_model, out)
    path = offline_throughput.main([*argv, "--max-num-seqs", "4"])
    doc = json.loads(Path(path).read_text())
    assert path == out and doc["complete"] and doc["errors"] == [] and doc["skipped"] == []
    assert doc["rates"]["hbm_gbps"] > 0 and doc["rates"]["matmul_tflops"] > 0
    assert doc["reference"]["goal_tok_s"]["128/128"] == 17000.0
    rows = {r["shape"]: r for r in doc["tandem"]}
    assert set(rows) == {"16/8", "24/4"} and {r["variant"] for r in doc["tandem"]} == {"bf16"}
    assert list(doc["variants"]) == ["bf16"] and doc["variants"]["bf16"]["model_cost"] == doc["model_cost"]
    for shape, n, out_len in (("16/8", 6, 8), ("24/4", 3, 4)):
        r = rows[shape]
        assert r["complete"] and r["output_tokens"] == n * out_len
        assert (
            r["batch"] == min(n, 4) and 1 <= r["steps"]["peak_running"] <= r["batch"]
        )  # the admission limit
        assert r["steps"]["preempted"] == 0 and r["steps"]["prefill_steps"] >= 1
        assert r["steps"]["decode_steps"] >= out_len - 1
        assert 0 < r["steps"]["prefill_s"] + r["steps"]["decode_s"] <= r["wall_s"]
        assert r["output_tok_s"] == pytest.approx(r["output_tokens"] / r["wall_s"])
        assert r["ceiling"]["output_tokens"] == r["output_tokens"] and r["ceiling"]["tokens_per_s"] > 0
        assert r["fraction_of_ceiling"] == pytest.approx(r["output_tok_s"] / r["ceiling"]["tokens_per_s"])
        assert r["reference_tok_s"] is None  # no published number for toy shapes
        assert r["speedup_vs_bf16"] is None and r["speedup_goal"] is None
    hf = {r["shape"]: r for r in doc["transformers"]}
    for shape, out_len in (("16/8", 8), ("24/4", 4)):
        h = hf[shape]
        assert h["batch"] == 8 and h["attempts"] == ["8: ran"] and h["complete"]  # the largest batch tried
        assert h["output_tokens"] == h["batch"] * out_len * h["batches_timed"] and h["output_tok_s"] > 0


def test_offline_throughput_fp8_variants_compare_with_bf16(tiny_model, tmp_path):
    out = tmp_path / "offline.json"
    argv = _smoke_argv(tiny_model, out)
    offline_throughput.main([*argv, "--max-num-seqs", "4", "--variants", "fp8,bf16", "--skip-hf"])
    doc = json.loads(out.read_text())
    assert doc["complete"] and doc["errors"] == [] and doc["transformers"] == []
    assert list(doc["variants"]) == ["bf16", "fp8"]  # bf16 first, whatever the order given
    assert (
        doc["reference"]["fp8_goal_tok_s"]["128/128"] == 21200.0 and doc["reference"]["speedup_goal"] == 1.6
    )
    rows = {(r["variant"], r["shape"]): r for r in doc["tandem"]}
    assert set(rows) == {(v, s) for v in ("bf16", "fp8") for s in ("16/8", "24/4")}
    costs = {v: ModelCost(**doc["variants"][v]["model_cost"]) for v in ("bf16", "fp8")}
    mc = load_model_config(resolve_model(tiny_model))
    assert costs["fp8"] == ModelCost.from_config(mc, dtype_bytes=4, fp8_weights=True, fp8_kv=True)
    per_head = mc.num_layers * 2 * mc.num_kv_heads  # K and V rows of one token; float32 in the smoke
    assert costs["bf16"].kv_bytes_per_token == per_head * mc.head_dim * 4
    assert costs["fp8"].kv_bytes_per_token == per_head * (mc.head_dim + 2)
    assert doc["variants"]["fp8"]["engine"]["kv_dtype"] == "float8_e4m3fn"
    rates = DeviceRates(doc["rates"]["hbm_gbps"], doc["rates"]["matmul_tflops"])
    for shape, n, out_len in (("16/8", 6, 8), ("24/4", 3, 4)):
        bf16, fp8 = rows["bf16", shape], rows["fp8", shape]
        for r in (bf16, fp8):
            assert r["complete"] and r["output_tokens"] == n * out_len  # each request got all its tokens
            floor = throughput_floor(costs[r["variant"]], rates, n, *map(int, shape.split("/")), r["batch"])
            assert r["ceiling"] == pytest.approx(dataclasses.asdict(floor))  # the variant's own bytes
        assert (
            fp8["ceiling"]["decode_bytes"] < bf16["ceiling"]["decode_bytes"] and fp8["batch"] == bf16["batch"]
        )
        assert fp8["ceiling"]["tokens_per_s"] >= bf16["ceiling"]["tokens_per_s"]
        assert fp8["speedup_vs_bf16"] == pytest.approx(fp8["output_tok_s"] / bf16["output_tok_s"])
        assert fp8["speedup_goal"] == 1.6 and fp8["fp8_goal_tok_s"] is None  # no FP8 goal for toy shapes
        assert bf16["speedup_vs_bf16"] is None and fp8["goal_tok_s"] is None  # the 60% goal is bf16's


def test_versus_bf16_goals_and_an_unknown_variant():
    fp8, kv = offline_variants.VARIANTS["fp8"], offline_variants.VARIANTS["fp8-kv"]
    rows = [{"variant": "bf16", "shape": "128/128", "complete": True, "output_tok_s": 10000.0}]
    assert offline_variants.versus_bf16(fp8, "128/128", 16960.0, rows) == offline_variants.VersusBf16(
        1.696, 21200.0, 0.8, 1.6, "bf16"
    )
    assert offline_variants.versus_bf16(kv, "128/128", 12000.0, rows) == offline_variants.VersusBf16(
        1.2, versus="bf16"
    )
    assert offline_variants.versus_bf16(fp8, "2048/128", 2600.0, rows).speedup_vs_bf16 is None  # bf16 not run
    cut = [{**rows[0], "complete": False}]  # stopped by the budget: its rate covers part of the work
    assert offline_variants.versus_bf16(kv, "128/128", 12000.0, cut).speedup_vs_bf16 is None
    names = [v.name for v in offline_variants.parse_variants("fp8, fp8-weights,bf16,fp8")]
    assert names == ["bf16", "fp8-weights", "fp8"]
    ahead = offline_variants.VARIANTS["fp8-ahead"]  # FP8 weights and KV, steps ahead: the goals apply
    assert (ahead.quantization, ahead.cache_dtype, ahead.ahead, fp8.ahead) == ("fp8", "fp8_e4m3", True, False)
    assert ahead.cost(load_model_config(resolve_model("dummy:llama-3-8b")), 2) == fp8.cost(
        load_model_config(resolve_model("dummy:llama-3-8b")), 2
    )  # same bytes: only the scheduling differs
    assert offline_variants.versus_bf16(ahead, "128/128", 16960.0, rows).fp8_goal_tok_s == 21200.0
    # Steps ahead compare with bf16's steps ahead when the run has them (and bf16 ahead with bf16), else bf16.
    assert offline_variants.versus_bf16(ahead, "128/128", 16960.0, rows).versus == "bf16"
    both = [*rows, {**rows[0], "variant": "bf16-ahead", "output_tok_s": 12000.0}]
    got = offline_variants.versus_bf16(ahead, "128/128", 16960.0, both)
    assert (got.versus, got.speedup_vs_bf16) == ("bf16-ahead", pytest.approx(16960.0 / 12000.0))
    exact = offline_variants.VARIANTS["fp8-ahead-exact"]
    assert (exact.fast_accum, ahead.fast_accum) == (False, True) and exact.cost(
        load_model_config(resolve_model("dummy:llama-3-8b")), 2
    ) == ahead.cost(load_model_config(resolve_model("dummy:llama-3-8b")), 2)
    got = offline_variants.versus_bf16(offline_variants.VARIANTS["bf16-ahead"], "128/128", 12000.0, both)
    assert (got.versus, got.speedup_vs_bf16) == ("bf16", 1.2)
    with pytest.raises(SystemExit, match=r"--variants: unknown 'fp4'.*bf16, fp8-weights, fp8-kv, fp8"):
        offline_throughput.main(["--smoke", "--variants", "bf16,fp4"])


def test_offline_throughput_records_a_failed_job_and_still_runs_the_rest(tiny_model, tmp_path):
    out = tmp_path / "offline.json"
    argv = ["--smoke", "--model", tiny_model, "--out", str(out), "--shapes", "16/4", "--num-prompts", "2"]
    with pytest.raises(SystemExit, match="tandem engine"):
        offline_throughput.main([*argv, "--gpu-memory-utilization", "2.0"])  # the engine's config rejects it
    doc = json.loads(out.read_text())
    assert not doc["complete"] and doc["tandem"] == []
    assert (
        doc["errors"][0]["job"] == "tandem engine" and "gpu_memory_utilization" in doc["errors"][0]["error"]
    )
    assert [r["shape"] for r in doc["transformers"]] == ["16/4"]  # later jobs ran


def test_offline_throughput_spent_budget_skips_jobs_but_writes_json(tiny_model, tmp_path):
    out = tmp_path / "offline.json"
    argv = ["--smoke", "--model", tiny_model, "--out", str(out), "--budget-s", "0.001"]
    offline_throughput.main([*argv, "--variants", "bf16,fp8-weights"])
    doc = json.loads(out.read_text())
    assert doc["skipped"] == ["tandem engine", "tandem fp8-weights engine", "transformers model"]
    assert not doc["complete"]
    assert doc["tandem"] == [] and doc["rates"]["hbm_gbps"] > 0


def test_ttft_smoke_one_prefill_step_per_prompt(tiny_model, tmp_path):
    out = tmp_path / "ttft.json"
    path = ttft.main(
        ["--smoke", "--model", tiny_model, "--out", str(out), "--prompt-lens", "16,32", "--reps", "3"]
    )
    doc = json.loads(Path(path).read_text())
    assert doc["complete"] and [r["prompt_len"] for r in doc["rows"]] == [16, 32]
    cost = ModelCost(**doc["model_cost"])
    assert cost == ModelCost.from_config(load_model_config(resolve_model(tiny_model)), dtype_bytes=4)
    for r in doc["rows"]:
        assert r["reps"] == 3 and r["steps_to_first_token"] == 1  # the chunk budget covers the prompt
        assert 0 < r["min_ms"] <= r["median_ms"] <= r["max_ms"] and 0 < r["step_ms"] <= r["max_ms"]
        assert r["floor"]["flops"] == cost.prefill_flops(r["prompt_len"])
        median_s = r["median_ms"] / 1e3
        assert r["fraction_of_flop_floor"] == pytest.approx(r["floor"]["flop_s"] / median_s)
        assert r["achieved_tflops"] == pytest.approx(r["floor"]["flops"] / median_s / 1e12)


def test_prompt_scoring_smoke_scores_every_prompt_and_counts_the_head_rows(tiny_model, tmp_path):
    """bench/prompt_scoring.py --smoke: plain, then each --top variant, every scored request checked for a score
    per prompt token after its first (the script raises otherwise); a scored variant's floor adds one logits row
    per scored token."""
    out = tmp_path / "scoring.json"
    argv = ["--smoke", "--model", tiny_model, "--out", str(out), "--num-prompts", "3", "--prompt-len", "20"]
    doc = json.loads(Path(prompt_scoring.main([*argv, "--top", "0,2", "--reps", "2"])).read_text())
    assert doc["complete"] and [r["variant"] for r in doc["rows"]] == ["plain", "top-0", "top-2"]
    cost = ModelCost(**doc["model_cost"])
    rates = DeviceRates(**{k: v for k, v in doc["rates"].items() if k != "matmul_n"})
    plain, *scored = doc["rows"]
    assert plain["vs_plain"] is None and plain["floor_s"] == pytest.approx(
        cost.compute_s(rates, 3 * cost.prefill_flops(20), 60)
    )
    for row in scored:
        head = 3 * 19 * 2 * cost.head_params
        assert row["floor_s"] == pytest.approx(cost.compute_s(rates, 3 * cost.prefill_flops(20) + head, 60))
        assert row["vs_plain"] == pytest.approx(row["tokens_per_s"] / plain["tokens_per_s"])
        assert row["tokens_per_s"] == pytest.approx(60 / row["median_s"])
    with pytest.raises(SystemExit, match="--top"):
        prompt_scoring.main([*argv, "--top", "21"])


def test_ttft_with_a_cached_prefix_counts_only_the_new_tokens(tiny_model, tmp_path):
    out = tmp_path / "ttft.json"
    argv = ["--smoke", "--model", tiny_model, "--out", str(out), "--prompt-lens", "8", "--reps", "2"]
    ttft.main([*argv, "--cached-prefix", "32", "--graph-kv-store"])
    doc = json.loads(out.read_text())
    assert (
        doc["prefill_graph_kv_store"] is True
    )  # (a CPU engine builds no graphs: the setting is only recorded)
    (row,) = doc["rows"]
    cost = ModelCost(**doc["model_cost"])
    assert row["cached_prefix"] == 32 and row["steps_to_first_token"] == 1
    assert row["floor"]["flops"] == cost.prefill_flops(40, cached=32) < cost.prefill_flops(40)
    # 8 new tokens attend to 32 cached keys and to themselves causally
    assert cost.prefill_flops(40, cached=32) - cost.prefill_flops(8) == cost.attn_flops_per_key * 32 * 8
    with pytest.raises(SystemExit, match="--cached-prefix"):
        ttft.main([*argv, "--cached-prefix", "32", "--warmup", "0"])


def test_ttft_counts_chunked_prefill_steps(tiny_model, tmp_path):
    out = tmp_path / "ttft.json"
    argv = ["--smoke", "--model", tiny_model, "--out", str(out), "--prompt-lens", "32", "--reps", "1"]
    ttft.main([*argv, "--warmup", "0", "--max-num-batched-tokens", "8"])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["steps_to_first_token"] == 4  # 32 prompt tokens in chunks of 8


def smoke_script(name: str, out: Path) -> dict:
    """Run bench/<name> --smoke in its own process (the scripts start processes of their own); its JSON."""
    script = Path(__file__).resolve().parents[2] / "bench" / name
    done = subprocess.run(
        [sys.executable, str(script), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_tp_decode_smoke_times_the_lead_while_a_follower_follows(tmp_path):
    """bench/tp_decode.py on a CPU (two ranks over gloo, dummy:tiny-llama in float32): rank 0 publishes each
    step as an engine's lead does and rank 1 follows it (a follower that did not would hang the lead's next
    collective); each row counts rank 0's own share of the model: half the KV heads and about half the
    weights."""
    doc = smoke_script("tp_decode.py", tmp_path / "tp.json")
    assert (doc["gpus"], doc["gpu"]) == (2, "cpu")
    whole = ModelCost.from_config(load_model_config(resolve_model("dummy:tiny-llama")), dtype_bytes=4)
    assert [(r["phase"], r["batch"], r["context"]) for r in doc["rows"]] == [
        ("decode", 2, 32),
        ("decode", 4, 32),
        ("prefill", 1, 48),
    ]
    for row in doc["rows"]:
        tokens = row["batch"] * (row["context"] + 1) if row["phase"] == "decode" else row["context"]
        assert row["kv_bytes"] == tokens * whole.kv_bytes_per_token // 2, row
        assert 0.4 * whole.weight_bytes_read < row["weight_bytes"] < 0.7 * whole.weight_bytes_read, row
        assert row["step_us"] > 0 and row["allreduce_us"] > 0, row  # no order between timings on a shared box
        assert set(row["allreduce_paths_us"]) == {"step", "nccl"}, row  # no symmetric memory on a CPU
    # Every timed step's host timeline, from both ranks' records: the follower received each step after the
    # lead started it (one clock on one host), and the lead had the ids after it had queued the step.
    timeline = doc["host_timeline_us"]
    assert set(timeline) == {"decode batch 2 ctx 32", "decode batch 4 ctx 32", "prefill 48"}
    for spans in timeline.values():
        assert 0 < spans["rank1_received"] <= spans["rank1_queued"], spans
        assert (
            0 < spans["lead_built"] <= spans["lead_published"] <= spans["lead_queued"] <= spans["lead_done"]
        )
    assert not list(tmp_path.glob("*.steps.json")), "the ranks' step records are removed once merged"


def test_fused_rows_smoke_checks_every_silu_fp8_variant_byte_for_byte(tmp_path):
    """bench/fused_rows.py on a CPU (Triton's interpreter): silu_mul_fp8 at every warp count it times wrote the
    same codes and scales (the script exits 1 when one differs)."""
    doc = smoke_script("fused_rows.py", tmp_path / "fused.json")
    assert doc["gpu"] == "cpu" and [r["rows"] for r in doc["rows"]] == [1, 3]
    assert doc["variants"] == {"row": None, "row/w4": 4, "row/w8": 8, "row/w32": 32}
    assert all(r["wrong"] == [] and "us" not in r for r in doc["rows"])


def test_ttft_variant_builds_its_engine_and_counts_its_bytes(tiny_model, tmp_path):
    out = tmp_path / "ttft.json"
    argv = ["--smoke", "--model", tiny_model, "--out", str(out), "--prompt-lens", "16", "--reps", "1"]
    ttft.main([*argv, "--variant", "fp8-exact"])
    doc = json.loads(out.read_text())
    assert doc["variant"] == "fp8-exact" and doc["complete"] and doc["rows"][0]["steps_to_first_token"] == 1
    mc = load_model_config(resolve_model(tiny_model))
    assert ModelCost(**doc["model_cost"]) == ModelCost.from_config(mc, 4, fp8_weights=True, fp8_kv=True)
    with pytest.raises(SystemExit):
        ttft.main([*argv, "--variant", "fp4"])


def test_fp8_matmul_smoke_checks_every_projection_against_bf16(tmp_path):
    """bench/fp8_matmul.py on a CPU (emulated FP8, nothing timed): each toy projection's FP8 output within FP8's
    error of the bf16 product, per-row and per-group scales alike (the script exits 1 past 8%)."""
    doc = smoke_script("fp8_matmul.py", tmp_path / "fp8.json")
    assert [(r["projection"], r["tokens"]) for r in doc["rows"]] == [
        ("qkv", 1),
        ("qkv", 4),
        ("down", 1),
        ("down", 4),
    ]
    for r in doc["rows"]:
        errs = r["err_vs_bf16"]
        assert 0 < errs["fp8"] < 0.08 and 0 < errs["fp8_group"] < 0.08, r
        assert "us" not in r and "accum_err" not in r  # timing and the accumulation check are the GPU's


def test_out_may_name_a_folder_or_a_file(tmp_path: Path) -> None:
    """--out given a folder that exists puts the default file name in it (a device run once measured for a minute
    and then failed to write its JSON over a folder); a file path is taken as it is."""
    from bench.harness import result_path

    assert result_path(str(tmp_path), "ttft", "cpu", smoke=True) == tmp_path / "ttft_smoke.json"
    named = result_path(str(tmp_path), "ttft", "cpu", smoke=False)
    assert named.parent == tmp_path and named.name.startswith("ttft_") and named.suffix == ".json"
    assert result_path(str(tmp_path / "x.json"), "ttft", "cpu", smoke=False) == tmp_path / "x.json"
    assert result_path(None, "ttft", "cpu", smoke=True).name == "ttft_smoke.json"
