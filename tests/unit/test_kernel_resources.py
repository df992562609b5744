"""The decode kernel compiled for an H100/H200 (sm_90) by the installed Triton, its bundled ptxas and cuobjdump,
on the CPU (bench/kernel_resources.py): what it issues, for the FP8 cache as the engine launches it there."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")


@pytest.fixture(scope="module")
def compiled():
    from bench import kernel_resources

    if not (kernel_resources._toolchain() / "cuobjdump").exists():
        pytest.skip("this triton has no bundled cuobjdump")
    return {k: kernel_resources.compile_kernel(k, arch=90) for k in kernel_resources.KERNELS}


def test_the_fp8_kernel_reads_v_whole_where_triton_alone_gathers_it_byte_by_byte(compiled):
    """The engine's FP8 launch converts V where it is loaded (fused/e4m3.e4m3_to_float16): no single-byte
    shared-memory loads. Left to Triton (the plain conversion, as on pre-sm_89 devices), the e4m3 V tile is
    gathered into the PV operand a byte at a time; if a Triton ever stops doing that, this test says the inline
    conversion may no longer be needed."""
    fp8, plain = compiled["fp8"], compiled["fp8-plain"]
    assert fp8.shared_byte_loads == 0, fp8
    assert plain.shared_byte_loads >= 64, plain
    assert fp8.e4m3_conversions > 0 and fp8.mma == plain.mma > 0


def test_the_fp8_kernel_stays_within_its_register_cap_and_the_bf16_kernel_gathers_nothing(compiled):
    from model_runtime.attention.decode_plan import DecodeTuning

    cap = DecodeTuning().fp8_max_registers
    assert cap is not None and compiled["fp8"].registers <= cap
    assert compiled["fp8-plain"].registers <= cap  # the cap is passed to the compiler: maxnreg reached it
    assert compiled["bf16"].shared_byte_loads == 0 and compiled["bf16"].mma > 0


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("fp8_max_registers", 100, "multiple of 8"),
        ("fp8_max_registers", 16, "multiple of 8 in \\[24, 255\\]"),
        ("fp8_max_registers", 256, "got 256"),
        ("fp8_tile_n", 48, "power of two"),
        ("fp8_num_stages", 0, "in \\[1, 6\\]"),
    ],
)
def test_decode_tuning_refuses_bad_values_naming_the_field(field: str, value: int, message: str) -> None:
    from model_runtime.attention.decode_plan import DecodeTuning

    with pytest.raises(ValueError, match=f"DecodeTuning.{field}: must be .*{message}"):
        DecodeTuning(**{field: value})
    assert DecodeTuning(fp8_max_registers=None).fp8_max_registers is None  # None: the compiler's choice


def test_the_small_batch_fp8_matmul_runs_e4m3_wgmma_on_the_codes_as_stored() -> None:
    """skinny_matmul_fp8 at every autotune configuration, compiled for sm_90: the weight tile as the dot's left
    operand makes Triton issue Hopper's e4m3 wgmma on the codes as loaded. With the token rows on the left (16 of
    them, under the wgmma's 64) Triton converts both operands to float16 for mma.sync instead, which ran at about
    half the speed (docs/performance.md, "FP8 at small batches"): this test fails then."""
    from bench import kernel_resources
    from model_runtime.fused.skinny_matmul import _TUNED_FP8

    if not (kernel_resources._toolchain() / "cuobjdump").exists():
        pytest.skip("this triton has no bundled cuobjdump")
    for config in _TUNED_FP8.configs:
        r = kernel_resources.compile_skinny_fp8(config, arch=90)
        assert r.e4m3_mma == r.wgmma > 0 and r.e4m3_conversions == 0 and r.mma == 0, (config, r)
