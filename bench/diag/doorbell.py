"""Can a KV pull be armed on the receiver's GPU before the sender is ready, and started by the sender's GPU
alone? A feasibility probe for issue 13's host path (two GPUs, two processes, about a minute).

    NCCL_NVLS_ENABLE=0 PYTHONPATH=. python3 bench/diag/doorbell.py --mib 16,256,1024 --reps 20

A doorbell page: one page of /dev/shm that both processes pin (cuMemHostRegister, device-mapped). The receiver
queues on its own stream `cuStreamWaitValue32(bell >= n)`, then a peer copy of the sender's buffer (opened
through CUDA IPC) into its own, then `cuStreamWriteValue32(done = n)`, all before the sender is told to go. The
sender rings with `cuStreamWriteValue32(bell = n)` on its stream (in a handoff: after the prefill's kernels);
the receiver's host learns the copy ended by reading the page (no driver call, no event). Printed per size:

- armed: the sender's host ringing -> the receiver's host seeing `done` (time.monotonic, one host)
- launched: the same copy queued by the receiver's host on being told, then the same `done` read (what a
  handoff does today, less its frames and threads)
- copy: the copy alone, CUDA events on the receiver's stream
(The issue's baseline, raw NCCL send/recv, comes from bench/kv_transfer.py on the same machine.)

Then two hazards of a wait queued on the GPU: whether kernels on other streams of the receiver's process still run
while an armed wait is pending (a wait at the head of a hardware queue holds every stream that shares it:
CUDA_DEVICE_MAX_CONNECTIONS, 8 by default), and whether the receiver's host can release its own armed wait
(abort) by writing the page.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import statistics
import threading
import time
from multiprocessing import shared_memory
from typing import Any

PAGE = 4096
BELL, DONE = 0, 16  # uint32 word indexes (separate 64-byte lines)
WAIT_GEQ = 0x0
REGISTER_PORTABLE_DEVICEMAP = 0x1 | 0x2
WATCHDOG_S = 3.0
LOAD_FIRST = os.environ.get("DOORBELL_LOAD_FIRST", "1") == "1"


class Driver:
    def __init__(self) -> None:
        lib = ctypes.PyDLL("libcuda.so.1")
        p, u, s = ctypes.c_void_p, ctypes.c_uint, ctypes.c_size_t
        u64 = ctypes.c_uint64

        def fn(name: str, args: list[Any]) -> Any:
            f = getattr(lib, name)
            f.argtypes, f.restype = args, ctypes.c_int
            return f

        self.register = fn("cuMemHostRegister_v2", [p, s, u])
        self.device_ptr = fn("cuMemHostGetDevicePointer_v2", [ctypes.POINTER(u64), p, u])
        self.wait = fn("cuStreamWaitValue32_v2", [p, u64, ctypes.c_uint32, u])
        self.write = fn("cuStreamWriteValue32_v2", [p, u64, ctypes.c_uint32, u])
        self.copy = fn("cuMemcpyDtoDAsync_v2", [u64, u64, s, p])

    @staticmethod
    def ok(code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what} failed: CUresult {code}")


def pin_page(drv: Driver, shm: shared_memory.SharedMemory) -> tuple[Any, int]:
    """The page as a ctypes uint32 array and its device address in this process."""
    assert shm.buf is not None
    words = (ctypes.c_uint32 * (PAGE // 4)).from_buffer(shm.buf)
    host = ctypes.addressof(words)
    drv.ok(drv.register(host, PAGE, REGISTER_PORTABLE_DEVICEMAP), "cuMemHostRegister")
    dptr = ctypes.c_uint64()
    drv.ok(drv.device_ptr(ctypes.byref(dptr), host, 0), "cuMemHostGetDevicePointer")
    return words, dptr.value


def spin_until(words: Any, index: int, value: int, timeout_s: float = 2.0) -> float:
    deadline = time.monotonic() + timeout_s
    while words[index] != value:
        if time.monotonic() > deadline:
            raise TimeoutError(f"word {index} never became {value} (is {words[index]})")
    return time.monotonic()


def say(*what: Any) -> None:
    print(f"[{os.getpid()} {time.monotonic():.3f}]", *what, flush=True)


def sender(conn: Any, shm_name: str, sizes: list[int], reps: int) -> None:
    import cupy
    import torch

    torch.cuda.set_device(0)
    cupy.cuda.Device(0).use()
    drv = Driver()
    shm = shared_memory.SharedMemory(shm_name)
    torch.empty(1, device="cuda")
    words, bell_dev = pin_page(drv, shm)
    say("sender: page pinned")
    stream = torch.cuda.Stream()
    buf = torch.randint(0, 255, (max(sizes),), dtype=torch.uint8, device="cuda")
    handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(buf.data_ptr()))
    conn.send(handle)
    while True:
        msg = conn.recv()
        if msg is None:
            break
        gen = msg
        time.sleep(0.002)  # the receiver armed; let its wait settle
        t0 = time.monotonic()
        drv.ok(drv.write(stream.cuda_stream, bell_dev, gen, 0), "cuStreamWriteValue32")
        conn.send(t0)
    del words
    shm.close()


def receiver(conn: Any, shm_name: str, sizes: list[int], reps: int, out: Any) -> None:
    try:
        _receiver(conn, shm_name, sizes, reps, out)
    except BaseException as exc:
        out.put({"error": f"{type(exc).__name__}: {exc}"})
        raise


def _receiver(conn: Any, shm_name: str, sizes: list[int], reps: int, out: Any) -> None:
    import cupy
    import torch

    torch.cuda.set_device(1)
    cupy.cuda.Device(1).use()
    drv = Driver()
    shm = shared_memory.SharedMemory(shm_name)
    torch.empty(1, device="cuda")
    words, page_dev = pin_page(drv, shm)
    say("receiver: page pinned")
    bell_dev, done_dev = page_dev + 4 * BELL, page_dev + 4 * DONE
    stream = torch.cuda.Stream(priority=-64)
    peer = int(cupy.cuda.runtime.ipcOpenMemHandle(conn.recv()))
    dst = torch.empty(max(sizes), dtype=torch.uint8, device="cuda")
    rows: list[dict[str, Any]] = [{"mib": size >> 20} for size in sizes]
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gen = 0
    for row in rows:
        size = row["mib"] << 20
        armed, launched, copy = [], [], []
        for i in range(reps + 3):
            gen += 1
            ev0.record(stream)
            drv.ok(drv.wait(stream.cuda_stream, bell_dev, gen, WAIT_GEQ), "cuStreamWaitValue32")
            drv.ok(drv.copy(dst.data_ptr(), peer, size, stream.cuda_stream), "cuMemcpyDtoDAsync")
            ev1.record(stream)
            drv.ok(drv.write(stream.cuda_stream, done_dev, gen, 0), "cuStreamWriteValue32")
            conn.send(gen)
            t0 = conn.recv()
            if i == 0:
                say(
                    f"receiver: first armed copy of {size >> 20} MiB rung; bell {words[BELL]} done {words[DONE]}"
                )
            t1 = spin_until(words, DONE, gen)
            stream.synchronize()
            if i >= 3:
                armed.append(t1 - t0)
                copy.append(ev0.elapsed_time(ev1) / 1e3)  # includes the wait: lower bound on the copy below
            gen += 1
            t0 = time.monotonic()
            drv.ok(drv.copy(dst.data_ptr(), peer, size, stream.cuda_stream), "cuMemcpyDtoDAsync")
            drv.ok(drv.write(stream.cuda_stream, done_dev, gen, 0), "cuStreamWriteValue32")
            t1 = spin_until(words, DONE, gen)
            stream.synchronize()
            ev0.record(stream)
            drv.ok(drv.copy(dst.data_ptr(), peer, size, stream.cuda_stream), "cuMemcpyDtoDAsync")
            ev1.record(stream)
            stream.synchronize()
            if i >= 3:
                launched.append(t1 - t0)
                copy[-1] = ev0.elapsed_time(ev1) / 1e3
        row.update(
            armed_s=statistics.median(armed),
            launched_s=statistics.median(launched),
            copy_s=statistics.median(copy),
        )
    conn.send(None)
    say("receiver: armed and launched done", rows)
    # Hazard 1: what in this process waits while an armed wait is pending. A watchdog rings after WATCHDOG_S;
    # each step's time says whether it waited for it.
    others = [torch.cuda.Stream() for _ in range(48)]
    tensors = []
    for s in others:
        with torch.cuda.stream(s):
            tensors.append(torch.ones(1024, device="cuda"))
            if LOAD_FIRST:  # the kernel's module loaded before arming (else its first launch loads it)
                tensors[-1].mul_(1)
    torch.cuda.synchronize()
    gen += 1
    drv.ok(drv.wait(stream.cuda_stream, bell_dev, gen, WAIT_GEQ), "cuStreamWaitValue32")
    released = torch.cuda.Event()
    released.record(stream)
    page = words

    def ring() -> None:
        page[BELL] = gen

    watchdog = threading.Timer(WATCHDOG_S, ring)
    t_armed = time.monotonic()
    watchdog.start()
    steps: dict[str, float] = {}

    def step(name: str, fn: Any) -> None:
        t = time.monotonic()
        fn()
        steps[name] = time.monotonic() - t
        say(f"receiver: {name}: {steps[name] * 1e3:.2f} ms")

    events = []

    def launch_all() -> None:
        for s, x in zip(others, tensors):
            with torch.cuda.stream(s):
                x.mul_(2)
                e = torch.cuda.Event()
                e.record(s)
                events.append(e)

    step("launch a kernel on each of 48 other streams", launch_all)
    step("sleep 0.2 s", lambda: time.sleep(0.2))
    held = sum(not e.query() for e in events)
    say(f"receiver: {held} of {len(events)} other streams' kernels not done 0.2 s after launch")
    step(
        "allocate 64 MiB (caching allocator, new segment)",
        lambda: torch.empty(64 << 20, dtype=torch.uint8, device="cuda"),
    )
    step("pinned host tensor", lambda: torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True))

    def wait_all() -> None:
        for e in events:
            e.synchronize()

    step("wait for the other streams' kernels", wait_all)
    # Hazard 2: the receiver releases its own wait by writing the page (the watchdog did if a step waited).
    words[BELL] = gen
    t0 = time.monotonic()
    while not released.query():
        if time.monotonic() - t0 > 5:
            raise TimeoutError("the host's write did not release the armed wait")
    released_s = time.monotonic() - t0
    watchdog.cancel()
    say(f"receiver: armed wait released {(time.monotonic() - t_armed) * 1e3:.1f} ms after arming")
    out.put(
        {
            "rows": rows,
            "max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "default"),
            "streams_held_behind_wait": held,
            "streams_tried": len(others),
            "steps_s": steps,
            "kernel_loaded_before_arming": LOAD_FIRST,
            "abort_release_s": released_s,
        }
    )
    words = page = None
    shm.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", default="16,256,1024")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    sizes = [int(m) << 20 for m in args.mib.split(",")]
    ctx = mp.get_context("spawn")
    shm = shared_memory.SharedMemory(create=True, size=PAGE)
    assert shm.buf is not None
    shm.buf[:PAGE] = bytes(PAGE)
    a, b = ctx.Pipe()
    out = ctx.Queue()
    procs = [
        ctx.Process(target=sender, args=(a, shm.name, sizes, args.reps)),
        ctx.Process(target=receiver, args=(b, shm.name, sizes, args.reps, out)),
    ]
    for p in procs:
        p.start()
    result = out.get(timeout=90)
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    if "error" in result:
        raise SystemExit(f"receiver failed: {result['error']}")
    shm.close()
    shm.unlink()
    print(f"CUDA_DEVICE_MAX_CONNECTIONS={result['max_connections']}")
    print(f"{'MiB':>6} {'copy':>12} {'armed':>12} {'launched':>12}")
    for r in result["rows"]:
        gbps = (r["mib"] << 20) / 1e9
        print(
            f"{r['mib']:>6} "
            + " ".join(f"{r[k] * 1e3:6.3f}ms/{gbps / r[k]:3.0f}" for k in ("copy_s", "armed_s", "launched_s"))
        )
    print(
        f"streams held behind a pending armed wait: {result['streams_held_behind_wait']} of "
        f"{result['streams_tried']}; wait released by the host's write in {result['abort_release_s'] * 1e3:.3f} ms"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
