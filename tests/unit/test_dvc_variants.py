"""bench/disagg_vs_colocated.py's deployment variants and their comparisons: "-nocache" turns every engine's
prefix cache off, "-autoscale" starts the SLO autoscaler within the deployment's GPUs; the summary compares TTFT
with and without the cache and the autoscaled capacity with the best fixed split."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from bench.dvc_deployments import pair_delta, smoke_config
from bench.dvc_names import config_gpus, deployment_config
from bench.dvc_summary import autoscaler_comparison, pair_transports, prefix_comparison
from deploy.config import parse_config
from model_runtime.config import DECODE_LATE_LAUNCH_MARGIN_S, LATE_LAUNCH_MARGIN_S, ConfigError

pytestmark = pytest.mark.unit


def _pools(config: dict) -> list[dict]:
    return [config[p] for p in ("prefill", "decode", "colocated") if p in config]


def test_nocache_turns_the_prefix_cache_off_in_every_pool_and_keeps_it_on_cpu() -> None:
    for name in ("colocated-nocache", "disagg-2p1d-nocache"):
        config = deployment_config(name)
        assert all(p["engine"]["cache"]["enable_prefix_caching"] is False for p in _pools(config))
        assert all(
            p["engine"]["cache"]["enable_prefix_caching"] is False
            for p in _pools(smoke_config(config, Path(tempfile.mkdtemp())))
        )
        parse_config(config)  # a valid deploy config (raises otherwise)
    plain = deployment_config("colocated")
    assert all(p["engine"]["cache"].get("enable_prefix_caching", True) for p in _pools(plain))


def test_autoscale_aims_at_the_slo_within_the_deployments_gpus() -> None:
    config = deployment_config("disagg-2p2d-autoscale", slo=(0.5, 0.025))
    scaler = config["autoscaler"]
    assert scaler["enabled"] and (scaler["ttft_s"], scaler["tpot_s"]) == (0.5, 0.025)
    assert scaler["max_total_workers"] == config_gpus(config) == 4
    assert scaler["prefill"] == scaler["decode"] == {"min": 1, "max": 3}
    assert (config["prefill"]["replicas"], config["decode"]["replicas"]) == (2, 2)  # where it starts
    parse_config(config)
    with pytest.raises(ValueError, match="-autoscale"):
        deployment_config("disagg-9p1d-autoscale")


def test_ipc_moves_the_kv_over_cuda_ipc_and_changes_nothing_else() -> None:
    config = deployment_config("disagg-1p1d-ipc")
    plain = deployment_config("disagg-1p1d")
    assert plain["transfer"]["kind"] == "nccl" and config["transfer"]["kind"] == "cuda_ipc"
    assert {k: v for k, v in config.items() if k != "transfer"} == {
        k: v for k, v in plain.items() if k != "transfer"
    }
    parse_config(config)


def test_both_lets_the_router_pick_cuda_ipc_or_nccl_per_pair_and_changes_nothing_else() -> None:
    config = deployment_config("disagg-1p1d-both")
    plain = deployment_config("disagg-1p1d")
    assert config["transfer"] == {
        "kinds": ["cuda_ipc", "nccl"]
    }  # the single "kind" is gone, not left to clash
    assert {k: v for k, v in config.items() if k != "transfer"} == {
        k: v for k, v in plain.items() if k != "transfer"
    }
    assert parse_config(config).transfer.kinds == ("cuda_ipc", "nccl")
    assert smoke_config(config, Path(tempfile.mkdtemp()))["transfer"] == {
        "kinds": ["tcp"]
    }  # CPU workers hold tcp only


def test_each_point_counts_its_own_pairs_and_the_summary_lists_them_by_transport() -> None:
    before = {"cuda_ipc:same": 10.0, "nccl:same": 2.0}
    after = {"cuda_ipc:same": 33.0, "nccl:same": 2.0, "nccl:cross": 1.0}
    assert pair_delta(before, after) == {"cuda_ipc:same": 23, "nccl:cross": 1}
    point = {**_point(2, 0.96, 0.150), "pairs": {"cuda_ipc:same": 23}, "kv_transfer": {"mean_s": 0.07},
             "samples": {"first_itl": [0.02, 0.01, 0.03]}}  # fmt: skip
    points = {"disagg-1p1d-both": [point], "colocated": [_point(2, 1.0, 0.1)]}
    rows = pair_transports(points)
    assert list(rows) == ["disagg-1p1d-both"]  # a deployment without recorded pairs is not listed
    assert rows["disagg-1p1d-both"] == [{"rate": 2, "pairs": {"cuda_ipc:same": 23}, "kv_handoff_mean_s": 0.07,
                                         "ttft_p50": 0.150, "ttft_p90": 0.150, "first_itl_p50": 0.02,
                                         "slo_share": 0.96}]  # fmt: skip


def test_nostream_ships_the_kv_after_the_first_token() -> None:
    config = deployment_config("disagg-1p1d-ipc-nostream")
    assert config["transfer"] == {"kind": "cuda_ipc", "layer_groups": 0}
    assert "layer_groups" not in deployment_config("disagg-1p1d")["transfer"]  # the default: streamed
    parse_config(config)


def _point(rate: float, share: float, ttft_p50: float, cached: int | None = None) -> dict:
    use = None if cached is None else {"prompt_tokens": 1000, "cached_tokens": cached}
    return {
        "settings": {"rate": rate},
        "goodput": {"share": share},
        "ttft": {"p50": ttft_p50, "p90": ttft_p50},
        "prefix_cache": use,
    }


def test_the_prefix_goal_is_judged_where_the_cacheless_deployment_keeps_up() -> None:
    points = {
        "colocated": [_point(1, 1.0, 0.05, 850), _point(2, 1.0, 0.05, 860), _point(4, 1.0, 0.06, 870)],
        "colocated-nocache": [_point(1, 1.0, 0.16), _point(2, 0.95, 0.20), _point(4, 0.4, 2.0)],
    }
    result = prefix_comparison(points)["colocated"]
    assert [r["rate"] for r in result["rates"]] == [1, 2, 4]
    assert result["rates"][0]["ratio"] == pytest.approx(3.2) and result["rates"][0]["cached_share"] == 0.85
    assert [r["off_within_slo"] for r in result["rates"]] == [True, True, False]
    assert result["goal_met"]
    points["colocated-nocache"][1] = _point(2, 0.95, 0.14)  # 2.8x at a rate it still serves: not met
    assert not prefix_comparison(points)["colocated"]["goal_met"]


def test_the_autoscaler_is_compared_with_the_best_fixed_split_on_as_many_gpus() -> None:
    runs = {d: {"gpus": g} for d, g in
            (("disagg-1p3d", 4), ("disagg-2p2d", 4), ("disagg-3p1d", 4), ("disagg", 2), ("disagg-2p2d-autoscale", 4))}  # fmt: skip
    caps = {"disagg-1p3d": 6, "disagg-2p2d": 10, "disagg-3p1d": 12, "disagg": 6, "disagg-2p2d-autoscale": 11}
    out = {d: {"capacity_rps": c} for d, c in caps.items()}
    points = {d: [] for d in runs}
    result = autoscaler_comparison(out, runs, points)["disagg-2p2d-autoscale"]
    assert result["best_fixed"] == "disagg-3p1d" and "disagg" not in result["fixed_capacity_rps"]
    assert result["ratio"] == pytest.approx(11 / 12) and result["goal_met"]
    out["disagg-2p2d-autoscale"]["capacity_rps"] = 10
    assert not autoscaler_comparison(out, runs, points)["disagg-2p2d-autoscale"]["goal_met"]


def test_tp_sizes_colocated_workers_and_counts_their_gpus_and_ptp_dtp_are_refused_there() -> None:
    config = deployment_config("colocated-2-tp2")
    assert config["colocated"]["replicas"] == 2
    assert config["colocated"]["engine"]["parallel"] == {"tensor_parallel_size": 2}
    assert config_gpus(config) == 4 and config_gpus(deployment_config("colocated-2")) == 2
    parse_config(config)
    smoke = smoke_config(deployment_config("colocated-1-tp3"), Path(tempfile.mkdtemp()))
    assert smoke["model"] == "smollm2-135m-instruct"  # its 3 KV heads split in 3 on the CPU
    assert smoke["colocated"]["engine"]["parallel"] == {"tensor_parallel_size": 3}
    assert smoke["colocated"]["num_gpus"] == 0
    parse_config(smoke)


def test_a_smoke_run_of_workers_spanning_2_4_or_8_devices_gets_a_model_whose_kv_heads_split(tmp_path) -> None:
    for name in ("disagg-1p1d-dtp2", "disagg-1p1d-ptp4", "colocated-1-tp8"):
        smoke = smoke_config(deployment_config(name), tmp_path / name)
        config = json.loads((Path(smoke["model"]) / "config.json").read_text())
        assert config["num_key_value_heads"] == 8 and config["num_attention_heads"] == 8
        assert all(p["num_gpus"] == 0 for p in _pools(smoke))
        parse_config(smoke)
    scaled = deployment_config("colocated-2-tp4-autoscale")
    assert (
        scaled["colocated"]["engine"]["parallel"]["tensor_parallel_size"] == 4
        and scaled["autoscaler"]["enabled"]
    )
    with pytest.raises(ValueError, match="colocated-2-ptp2: -ptpN sizes the prefill or decode workers"):
        deployment_config("colocated-2-ptp2")
    with pytest.raises(ValueError, match="-dtpN sizes the prefill or decode workers"):
        deployment_config("colocated-dtp4")


@pytest.mark.parametrize(
    ("name", "sizes", "gpus"),
    [
        ("disagg-1p1d", (1, 1), 2),
        ("disagg-2p2d-tp2", (2, 2), 8),  # both pools
        ("disagg-1p1d-ptp2", (2, 1), 3),  # the prefill worker only
        ("disagg-1p3d-dtp2", (1, 2), 7),  # the decode workers only
        ("disagg-1p2d-ptp4-dtp2", (4, 2), 8),  # one 4-GPU prefill worker, two 2-GPU decode workers
        ("disagg-1p2d-dtp2-ptp4", (4, 2), 8),  # in either order
        ("disagg-2p1d-tp2-dtp8", (2, 8), 12),  # a later suffix wins for its pool
        ("disagg-1p1d-ptp2-both-nocache", (2, 1), 3),  # beside the other suffixes
    ],
)
def test_tp_ptp_and_dtp_size_disaggregated_workers_and_the_gpus_count_every_rank(
    name: str, sizes: tuple[int, int], gpus: int
) -> None:
    config = deployment_config(name)
    assert config_gpus(config) == gpus  # replicas x tensor_parallel_size, summed over the pools
    parsed = parse_config(config)
    assert tuple(p.engine.parallel.tensor_parallel_size for p in (parsed.prefill, parsed.decode)) == sizes


def test_disaggregated_workers_of_different_sizes_keep_a_transport_and_a_fixed_gpu_count() -> None:
    """cuda_ipc copies whole caches, so alone it joins no pair of different sizes ("-both" adds nccl, which the
    router then picks); the SLO autoscaler counts workers, which are GPUs only at one size; and the handoff
    takes 1, 2, 4 or 8 ranks a worker."""
    assert deployment_config("disagg-1p1d-ptp2-both")["transfer"] == {"kinds": ["cuda_ipc", "nccl"]}
    same_size = deployment_config("disagg-1p1d-tp2-ipc")
    assert same_size["transfer"]["kind"] == "cuda_ipc"  # ranks of one size hold the same heads: whole caches
    parse_config(same_size)
    for name in ("disagg-1p1d-ptp2-ipc", "disagg-1p1d-ipc-dtp2"):
        with pytest.raises(ValueError, match=f"{name}: cuda_ipc copies whole caches, .* use -both"):
            deployment_config(name)
    scaled = deployment_config("disagg-2p2d-tp2-autoscale")
    assert scaled["autoscaler"]["max_total_workers"] == 4 and config_gpus(scaled) == 8
    parse_config(scaled)
    for name in ("disagg-2p2d-ptp2-autoscale", "disagg-2p2d-autoscale-dtp4"):
        with pytest.raises(ValueError, match="autoscaler's budget counts workers"):
            deployment_config(name)
    for name, pool in (("disagg-1p1d-tp3", "prefill"), ("disagg-1p1d-dtp6", "decode")):
        with pytest.raises(ValueError, match=f"{pool} workers span one of 1, 2, 4, 8 GPUs .* got [36]"):
            deployment_config(name)
    colocated = deployment_config("colocated-1-tp3")["colocated"]  # colocated workers hand no KV over
    assert colocated["engine"]["parallel"]["tensor_parallel_size"] == 3


def test_spill512_spills_and_cuts_the_decode_workers_step_budget_only() -> None:
    config = deployment_config("disagg-2p2d-spill512")
    plain = deployment_config("disagg-2p2d-spill")
    assert config["router"]["local_prefill_spill_tokens"] == plain["router"]["local_prefill_spill_tokens"] > 0
    assert config["decode"]["engine"]["scheduler"]["max_num_batched_tokens"] == 512
    assert config["prefill"] == plain["prefill"]  # the prefill pool keeps its whole-prompt steps
    assert (config["decode"]["replicas"], config["prefill"]["replicas"]) == (2, 2)
    parse_config(config)  # a valid deploy config (raises otherwise)


def test_router_processes_variant_sets_router_processes_and_composes_with_others() -> None:
    config = deployment_config("colocated-4-r3")
    plain = deployment_config("colocated-4")
    assert config["router"]["processes"] == 3 and "processes" not in plain.get("router", {})
    assert {k: v for k, v in config.items() if k != "router"} == {
        k: v for k, v in plain.items() if k != "router"
    }
    assert deployment_config("disagg-2p2d-ipc-r2")["transfer"]["kind"] == "cuda_ipc"
    assert parse_config(config).router.processes == 3
    with pytest.raises(ValueError, match="-rN"):
        deployment_config("colocated-4-r9")


def test_ahead_and_sync_set_step_ahead_scheduling_for_colocated_or_decode_workers() -> None:
    config = deployment_config("colocated-4-ahead")
    assert config["colocated"]["replicas"] == 4
    assert config["colocated"]["engine"]["scheduler"]["async_scheduling"] is True
    assert parse_config(config).colocated is not None
    assert smoke_config(config, Path(tempfile.mkdtemp()))["colocated"]["engine"]["scheduler"][
        "async_scheduling"
    ]
    # Disaggregated: the decode workers only (prefill workers refuse it).
    disagg = deployment_config("disagg-1p1d-ahead")
    assert disagg["decode"]["engine"]["scheduler"]["async_scheduling"] is True
    assert "async_scheduling" not in disagg["prefill"].get("engine", {}).get("scheduler", {})
    parsed = parse_config(smoke_config(disagg, Path(tempfile.mkdtemp())))
    assert (
        parsed.decode.engine.scheduler.async_scheduling
        and not parsed.prefill.engine.scheduler.async_scheduling
    )
    # Colocated and decode workers on one GPU schedule ahead by default; -sync is the engine without it, for A/B
    # runs (on a disaggregated name: the decode workers').
    plain = parse_config(deployment_config("disagg-1p1d"))
    assert plain.decode.engine.scheduler.async_scheduling
    assert not plain.prefill.engine.scheduler.async_scheduling
    assert parse_config(deployment_config("colocated-4")).colocated.engine.scheduler.async_scheduling
    sync = deployment_config("colocated-4-sync")
    assert not parse_config(sync).colocated.engine.scheduler.async_scheduling
    smoke = smoke_config(sync, Path(tempfile.mkdtemp()))
    assert not parse_config(smoke).colocated.engine.scheduler.async_scheduling
    assert not parse_config(deployment_config("disagg-3p1d-sync")).decode.engine.scheduler.async_scheduling


def test_early_turns_the_late_launch_off_where_steps_are_scheduled_ahead() -> None:
    plain, early = (
        parse_config(deployment_config("disagg-1p1d")),
        parse_config(deployment_config("disagg-1p1d-early")),
    )
    assert plain.decode.engine.scheduler.late_launch and not early.decode.engine.scheduler.late_launch
    assert early.decode.engine.scheduler.async_scheduling  # still ahead: only the launch moves
    colocated = parse_config(deployment_config("colocated-2-early")).colocated
    assert not colocated.engine.scheduler.late_launch and colocated.replicas == 2
    with pytest.raises(ValueError, match="-early"):
        deployment_config("disagg-1p1d-early-nonsense")


def test_pb_sets_the_prefill_sides_step_budget_only_and_refuses_a_budget_out_of_range() -> None:
    config, plain = deployment_config("disagg-2p2d-pb4096"), deployment_config("disagg-2p2d")
    assert config["prefill"]["engine"]["scheduler"]["max_num_batched_tokens"] == 4096
    assert plain["prefill"]["engine"]["scheduler"]["max_num_batched_tokens"] == 8192  # the config as written
    assert config["decode"] == plain["decode"] and config["prefill"]["replicas"] == 2
    others = {
        k: v for k, v in config["prefill"]["engine"]["scheduler"].items() if k != "max_num_batched_tokens"
    }
    assert others == {
        k: v for k, v in plain["prefill"]["engine"]["scheduler"].items() if k != "max_num_batched_tokens"
    }
    parse_config(config)
    colocated = deployment_config("colocated-4-pb1024-r2")
    assert colocated["colocated"]["engine"]["scheduler"]["max_num_batched_tokens"] == 1024
    assert colocated["colocated"]["replicas"] == 4 and colocated["router"]["processes"] == 2
    with pytest.raises(
        ValueError, match="disagg-1p1d-pb100: -pbN takes a step budget of 256-16384 tokens, got 100"
    ):
        deployment_config("disagg-1p1d-pb100")


def test_pg_sets_the_prompt_steps_graph_size_of_the_pool_that_runs_chunks() -> None:
    colocated = parse_config(deployment_config("colocated-1-pg2048")).colocated
    assert colocated.engine.device.prefill_graph_tokens == 2048
    assert parse_config(deployment_config("colocated-1")).colocated.engine.device.prefill_graph_tokens == 1024
    disagg = parse_config(deployment_config("disagg-1p1d-pb4096-pg0"))
    assert disagg.prefill.engine.device.prefill_graph_tokens == 0
    assert disagg.prefill.engine.scheduler.max_num_batched_tokens == 4096
    assert disagg.decode.engine.device.prefill_graph_tokens == 1024  # the decode pool as written
    with pytest.raises(ValueError, match="colocated-1-pg9000: -pgN takes 0-8192 tokens"):
        deployment_config("colocated-1-pg9000")


def test_device_suffixes_keep_the_engine_defaults_unless_given() -> None:
    device = parse_config(deployment_config("colocated-1")).colocated.engine.device
    assert (device.decode_gather_tokens, device.chunk_attention_tokens) == (8192, 1024)
    assert not device.prefill_graph_kv_store


@pytest.mark.parametrize(
    ("suffix", "key", "value"),
    [
        ("-dg4096", "decode_gather_tokens", 4096),
        ("-dg0", "decode_gather_tokens", 0),
        ("-ck256", "chunk_attention_tokens", 256),
        ("-ck0", "chunk_attention_tokens", 0),
        ("-gks1", "prefill_graph_kv_store", True),
        ("-gks0", "prefill_graph_kv_store", False),
    ],
)
def test_device_suffixes_set_every_pools_engine_device(suffix: str, key: str, value: object) -> None:
    colocated = parse_config(deployment_config(f"colocated-1{suffix}-nocache")).colocated.engine
    assert getattr(colocated.device, key) == value and not colocated.cache.enable_prefix_caching
    disagg = parse_config(deployment_config(f"disagg-1p1d{suffix}"))
    assert getattr(disagg.prefill.engine.device, key) == value
    assert getattr(disagg.decode.engine.device, key) == value


def test_fp8_puts_every_pools_weights_and_kv_cache_in_fp8() -> None:
    disagg = parse_config(deployment_config("disagg-1p1d-fp8"))
    for pool in (disagg.prefill, disagg.decode):  # both sides' caches match, so their KV can move
        assert pool.engine.device.quantization == "fp8" and pool.engine.cache.dtype == "fp8_e4m3"
    colocated = parse_config(deployment_config("colocated-4-fp8-early")).colocated
    assert colocated.engine.device.quantization == "fp8" and colocated.engine.cache.dtype == "fp8_e4m3"
    assert not colocated.engine.scheduler.late_launch and colocated.replicas == 4
    plain = parse_config(deployment_config("colocated-4")).colocated
    assert plain.engine.device.quantization == "none" and plain.engine.cache.dtype is None
    shrunk = parse_config(smoke_config(deployment_config("disagg-1p1d-fp8"), Path(tempfile.mkdtemp())))
    for pool in (shrunk.prefill, shrunk.decode):  # the CPU smoke runs the FP8 paths too (emulated)
        assert pool.engine.device.quantization == "fp8" and pool.engine.cache.dtype == "fp8_e4m3"
        assert pool.engine.device.device == "cpu"


def test_lm_sets_the_late_launch_margin_of_the_workers_that_launch_late() -> None:
    disagg = parse_config(deployment_config("disagg-1p1d-lm500"))
    assert disagg.decode.engine.scheduler.late_launch_margin_s == pytest.approx(0.0005)
    assert disagg.prefill.engine.scheduler.late_launch_margin_s == LATE_LAUNCH_MARGIN_S  # the default
    plain = parse_config(deployment_config("disagg-1p1d"))  # decode workers default to their own margin
    assert (
        plain.decode.engine.scheduler.late_launch_margin_s
        == DECODE_LATE_LAUNCH_MARGIN_S
        != LATE_LAUNCH_MARGIN_S
    )
    assert plain.prefill.engine.scheduler.late_launch_margin_s == LATE_LAUNCH_MARGIN_S
    assert parse_config(deployment_config("colocated-2")).colocated.engine.scheduler.late_launch_margin_s == (
        LATE_LAUNCH_MARGIN_S
    )
    colocated = parse_config(deployment_config("colocated-2-lm0")).colocated
    assert colocated.engine.scheduler.late_launch_margin_s == 0.0
    late = parse_config(deployment_config("disagg-1p1d-lm1500"))  # a decode pool that says so keeps its own
    assert late.decode.engine.scheduler.late_launch_margin_s == pytest.approx(0.0015)
    with pytest.raises(ConfigError, match=r"scheduler\.late_launch_margin_s: must be seconds in"):
        parse_config(deployment_config("disagg-1p1d-lm9000"))


def test_si_sets_the_routers_stream_interval_and_a_bad_one_is_refused_by_the_config() -> None:
    config = deployment_config("colocated-4-si4-r2")
    assert config["router"]["stream_interval"] == 4 and config["router"]["processes"] == 2
    assert parse_config(config).router.stream_interval == 4
    with pytest.raises(ConfigError, match=r"router\.stream_interval: must be an integer in \[1, 256\]"):
        parse_config(deployment_config("colocated-4-si0"))
