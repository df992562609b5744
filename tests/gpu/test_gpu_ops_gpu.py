"""kv_transfer.gpu_ops on a GPU: the raw driver calls (which keep the interpreter lock) and the torch/CuPy
fallback order work on streams alike, and block ids reach the device intact through reused buffers."""

from __future__ import annotations

import random

import pytest
import torch

from kv_transfer.gpu_ops import IdsPool, RawOps, TorchOps, gpu_ops, transfer_stream

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.fixture(params=["raw", "torch"])
def ops(request):
    if request.param == "torch":
        return TorchOps()
    chosen = gpu_ops()
    assert isinstance(chosen, RawOps), "libcuda.so.1 is loadable on a CUDA machine: raw calls must be chosen"
    return chosen


def test_a_wait_on_an_event_orders_two_streams(ops) -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    a, b = transfer_stream(device), transfer_stream(device)
    x = torch.zeros(1 << 20, device=device)
    # Load every kernel used below first: with lazy loading, a module's first launch can wait for the device's
    # running kernels (the 0.1 s sleep), which would complete the event before it is queried.
    torch.cuda._sleep(1000)
    x.fill_(0.0)
    _ = x * 2
    torch.cuda.synchronize(device)
    done = ops.new_event()
    with torch.cuda.stream(a):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time on stream a
        x.fill_(1.0)
    ops.record(done, a)
    ops.wait(b, done)
    with torch.cuda.stream(b):
        y = x * 2  # runs only after a's fill: b waited on the event
    assert not done.query(), "the event completed before the sleeping kernel did"
    b.synchronize()
    assert done.query()
    assert torch.equal(y, torch.full_like(x, 2.0))


def test_block_ids_arrive_intact_through_reused_buffers(ops) -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    stream = transfer_stream(device)
    pool = IdsPool(stream, capacity=4096)
    rng = random.Random(7)
    out = []
    for n in (1, 17, 4096, 300, 300):
        ids = tuple(rng.randrange(1, 1 << 40) for _ in range(n))
        on_device = ops.ids(pool, ids)
        with torch.cuda.stream(stream):
            out.append((ids, on_device.clone()))  # cloned on the stream that owns the buffer
    stream.synchronize()
    for ids, copy in out:
        assert copy.tolist() == list(ids)
    with pytest.raises(ValueError, match="exceed"):
        ops.ids(pool, tuple(range(4097)))


def test_transfer_streams_run_at_the_highest_priority() -> None:
    device = torch.device("cuda", 0)
    low, high = torch.cuda.Stream(device, priority=0).priority, transfer_stream(device).priority
    assert high < low  # lower is more urgent
    assert torch.cuda.Stream(device, priority=high - 1).priority == high


def test_timed_events_measure_the_work_between_them(ops) -> None:
    """elapsed_s (what a CopyClock learns a copy's rate from) agrees with the host's view of a ~0.1 s kernel,
    and an event pair around nothing reads about zero."""
    import time

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    stream = transfer_stream(device)
    torch.cuda._sleep(1000)  # load the kernel first (see above)
    torch.cuda.synchronize(device)
    start, end, empty = ops.new_event(timed=True), ops.new_event(timed=True), ops.new_event(timed=True)
    began = time.monotonic()
    ops.record(start, stream)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)
    ops.record(end, stream)
    ops.record(empty, stream)
    stream.synchronize()
    host = time.monotonic() - began
    gpu = ops.elapsed_s(start, end)
    assert 0.01 < gpu <= host + 1e-3, (gpu, host)
    assert 0 <= ops.elapsed_s(end, empty) < 1e-3
