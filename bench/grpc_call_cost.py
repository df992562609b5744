"""What a new gRPC call costs against a message on a stream already open: the question behind the router's
"one long-lived stream per router and worker" idea (docs/performance.md, "Where the time went").

Each request reaches a worker as a new server-streaming call (worker.proto: Prefill, Decode). Would one
bidirectional stream per router and worker, carrying every request, take much off the time to first token? This
times, on 127.0.0.1 with grpc.aio clients as the router's:

    new call   the first message of a new server-streaming call (what the router does per request today)
    stream     one message out and one back on a bidirectional stream opened beforehand

against a synchronous server (thread pool: the workers' servers) and an asyncio one, each in a process of its
own, payloads of --payload-bytes (9,000: a 2.2k-token prompt's ids as protobuf varints), serialized as raw bytes
so that only gRPC's own cost is timed. Writes JSON (--out) and prints the medians.

    python3 bench/grpc_call_cost.py [--n 300] [--payload-bytes 9000] [--out bench/results/grpc_call_cost_cpu.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.loopback

from tests.loopback import free_port


def _same(data: bytes) -> bytes:
    return data


def _sync_stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
    yield request


def _sync_bidi(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
    yield from requests


async def _aio_stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
    yield request


async def _aio_bidi(
    requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
) -> AsyncIterator[bytes]:
    async for message in requests:
        yield message


def _handlers(stream: Callable, bidi: Callable) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        "bench.Echo",
        {
            "Stream": grpc.unary_stream_rpc_method_handler(stream, _same, _same),
            "Bidi": grpc.stream_stream_rpc_method_handler(bidi, _same, _same),
        },
    )


def _quantiles(seconds: list[float]) -> dict[str, float]:
    ordered = sorted(seconds)
    return {
        "median_ms": statistics.median(ordered) * 1e3,
        "p90_ms": ordered[int(0.9 * len(ordered))] * 1e3,
    }


async def _time_client(port: int, n: int, payload: bytes) -> dict[str, dict[str, float]]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stream = channel.unary_stream(
            "/bench.Echo/Stream", request_serializer=_same, response_deserializer=_same
        )
        bidi = channel.stream_stream(
            "/bench.Echo/Bidi", request_serializer=_same, response_deserializer=_same
        )
        for _ in range(20):  # warm-up: connection, HTTP/2 settings, the server's threads
            async for _ in stream(payload):
                break
        new_call = []
        for _ in range(n):
            start = time.perf_counter()
            async for _ in stream(payload):
                break
            new_call.append(time.perf_counter() - start)
        call = bidi()
        await call.write(payload)
        await call.read()
        held = []
        for _ in range(n):
            start = time.perf_counter()
            await call.write(payload)
            await call.read()
            held.append(time.perf_counter() - start)
        await call.done_writing()
    return {"new call": _quantiles(new_call), "stream": _quantiles(held)}


def _serve(kind: str, port: int) -> None:
    """The server, in a process of its own (as a worker is to the router), until terminated."""
    if kind == "sync":
        server = grpc.server(futures.ThreadPoolExecutor(16))
        server.add_generic_rpc_handlers((_handlers(_sync_stream, _sync_bidi),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        server.wait_for_termination()
        return

    async def serve() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((_handlers(_aio_stream, _aio_bidi),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def _run(n: int, payload: bytes) -> dict[str, dict[str, dict[str, float]]]:
    results = {}
    spawn = multiprocessing.get_context("spawn")
    for kind, label in (("sync", "sync server"), ("aio", "asyncio server")):
        port = free_port()
        server = spawn.Process(target=_serve, args=(kind, port), daemon=True)
        server.start()
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                grpc.channel_ready_future(channel).result(timeout=30)
            results[label] = asyncio.run(_time_client(port, n, payload))
        finally:
            server.terminate()
            server.join(10)
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=300, help="timed requests per case")
    p.add_argument("--payload-bytes", type=int, default=9000)
    p.add_argument("--out", default="bench/results/grpc_call_cost_cpu.json")
    args = p.parse_args()
    if args.n < 10 or args.payload_bytes < 1:
        p.error("--n must be >= 10 and --payload-bytes >= 1")
    results = _run(args.n, b"x" * args.payload_bytes)
    for server, cases in results.items():
        for case, q in cases.items():
            print(f"{server:15s} {case:9s} median {q['median_ms']:.3f} ms, p90 {q['p90_ms']:.3f} ms")
    doc = {
        "benchmark": "gRPC: a new server-streaming call against a message on an open stream",
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "grpcio": grpc.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "settings": vars(args),
        "results": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
