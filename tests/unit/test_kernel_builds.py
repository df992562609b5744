"""model_runtime.kernel_builds: Triton's compile hooks counted and named, and the kernel arguments that change
from step to step kept out of Triton's specialization (each new specialization is a kernel built mid-run).

Triton cannot build a kernel on this GPU-less machine: the hooks are called here with the arguments Triton
gives them (triton/runtime/jit.py, JITFunction._call_hook); tests/gpu/test_kernel_builds_gpu.py drives a real
engine and asserts that nothing is built once it has started."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from triton import knobs
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend

from model_runtime import kernel_builds
from model_runtime.attention.triton_decode import _decode_segment_kernel
from model_runtime.fused.skinny_matmul import _skinny_kernel
from model_runtime.quantization.group_gemm import _group_mm_kernel


def _build(watch: kernel_builds._Watch, name: str) -> None:
    fn = SimpleNamespace(name=name, module="m")
    watch.before()
    watch.after(fn, f"{name}[num_warps=4](M: i32)")


def test_builds_before_the_start_count_as_start_up_and_later_ones_are_logged_by_name(caplog) -> None:
    watch = kernel_builds._Watch()
    _build(watch, "_warm_kernel")
    assert (watch.startup, watch.after_start) == (1, 0)
    assert not [r for r in caplog.records if r.name == kernel_builds.__name__]

    watch.started = True
    with caplog.at_level(logging.WARNING, logger=kernel_builds.__name__):
        _build(watch, "_late_kernel")
    assert (watch.startup, watch.after_start) == (1, 1)
    assert [n.split(" (")[0] for n in watch.names] == ["_warm_kernel", "_late_kernel"]
    assert ", after start) _late_kernel[num_warps=4](M: i32)" in watch.names[-1]
    (record,) = [r for r in caplog.records if r.name == kernel_builds.__name__]
    assert "_late_kernel" in record.getMessage() and "M: i32" in record.getMessage()


def test_the_names_kept_are_the_last_ones_and_the_counts_go_on() -> None:
    watch = kernel_builds._Watch()
    for i in range(kernel_builds.MAX_NAMES + 5):
        _build(watch, f"k{i}")
    assert watch.startup == kernel_builds.MAX_NAMES + 5
    assert len(watch.names) == kernel_builds.MAX_NAMES and watch.names[-1].startswith(
        f"k{watch.startup - 1} "
    )


def test_the_installed_hooks_count_triton_s_calls_and_keep_a_previous_hook_s_answer() -> None:
    seen: list[str] = []

    def previous_before(**kwargs):
        seen.append("before")
        return True  # "skip the build": the previous hook's answer must reach Triton unchanged

    def previous_after(**kwargs):
        seen.append("after")

    before, after = kernel_builds._chain_before(previous_before), kernel_builds._chain_after(previous_after)
    counted = kernel_builds.counts()
    fn = SimpleNamespace(name="_some_kernel", module="m")
    call = {"key": (), "repr": "_some_kernel[]()", "fn": fn, "compile": {}, "is_manual_warmup": False}
    assert before(**call, already_compiled=False) is True
    assert after(**call, already_compiled=False) is None
    assert seen == ["before", "after"]
    now = kernel_builds.counts()
    assert now.startup + now.after_start == counted.startup + counted.after_start + 1
    assert now.recent[-1].startswith("_some_kernel (")
    assert kernel_builds.watch() and kernel_builds.watch()  # once per process, then a no-op
    assert knobs.runtime.jit_post_compile_hook is not None and knobs.runtime.jit_cache_hook is not None


def _specializations(kernel, name: str, values: tuple[int, ...]) -> set:
    (param,) = [p for p in kernel.params if p.name == name]
    specialize, align = not param.do_not_specialize, not param.do_not_specialize_on_alignment
    return {native_specialize_impl(BaseBackend, v, param.is_const, specialize, align) for v in values}


@pytest.mark.parametrize(
    "kernel, argument",
    [
        (_decode_segment_kernel, "stride_bt"),  # the eager block table's width: the step's longest sequence
        (_skinny_kernel, "M"),  # the step's batch, or its sampled rows
        (_group_mm_kernel, "M"),  # the step's tokens
    ],
    ids=["decode-block-table-width", "skinny-rows", "group-gemm-rows"],
)
def test_arguments_that_change_between_steps_build_one_variant_whatever_their_value(kernel, argument) -> None:
    values = (1, 2, 15, 16, 17, 32, 1000)
    assert len(_specializations(kernel, argument, values)) == 1
    # The check can tell: an argument left to Triton's specialization (a cache stride) gives three.
    fixed = "stride_kn" if kernel is _decode_segment_kernel else "stride_wn"
    assert len(_specializations(kernel, fixed, values)) == 3
