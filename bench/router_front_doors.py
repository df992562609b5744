"""The router alone, for comparing its two front doors without engine noise: the real RouterServer (gRPC on
127.0.0.1:50071, the OpenAI HTTP API on 127.0.0.1:8071) in this process, and the fake prefill/decode workers of
the router's e2e tests (tests/e2e/fake_workers.py: one token every --step-s seconds per stream, no model) in a
child process. Runs until Ctrl-C; drive it with `tandem bench` (docs/performance.md has the commands):

    python bench/router_front_doors.py --step-s 0.02 &
    tandem bench --protocol openai --server http://127.0.0.1:8071 --concurrency 200 --num-requests 2000 \
        --input-len 16 --output-len 32
    tandem bench --protocol grpc --server 127.0.0.1:50071 --concurrency 200 --num-requests 2000 \
        --input-len 16 --output-len 32
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import sys
from multiprocessing.connection import Connection
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: tests.e2e.fake_workers

MODEL = "smollm2-135m-instruct"


def serve_fake_workers(conn: Connection, step_s: float) -> None:
    from router.model import ServedModel
    from tests.e2e.fake_workers import FakeDecode, FakePrefill, Landings, Script

    eos = ServedModel.load(MODEL).eos_token_ids
    script = Script(list(range(1000, 3000)), batch=1, step_s=step_s)  # no EOS: ignore_eos lengths hold

    async def main() -> None:
        landings = Landings()
        prefill = FakePrefill("prefill-0", script, landings, eos)
        decode = FakeDecode("decode-0", script, landings, eos, free_blocks=1_000_000)
        await prefill.serve()
        await decode.serve()
        conn.send([w.endpoint().SerializeToString() for w in (prefill, decode)])
        await asyncio.Event().wait()

    asyncio.run(main())


async def serve_router(endpoints: list[bytes], grpc_port: int, http_port: int, stream_interval: int) -> None:
    from router.config import RouterConfig
    from router.server import RouterServer
    from tandem_api.tandem.v1 import worker_pb2

    config = RouterConfig(
        port=grpc_port,
        http_port=http_port,
        max_inflight=4096,
        max_queue=4096,
        stream_interval=stream_interval,
    )
    router = RouterServer(config)
    await router.start()
    router.set_workers([worker_pb2.WorkerEndpoint.FromString(e) for e in endpoints])
    print(f"router: gRPC {router.address}, HTTP {router.http_address}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--step-s", type=float, default=0.02, help="seconds per token and stream (default 0.02)"
    )
    parser.add_argument("--grpc-port", type=int, default=50071)
    parser.add_argument("--http-port", type=int, default=8071)
    parser.add_argument(
        "--stream-interval", type=int, default=1, help="router.stream_interval: tokens per client message"
    )
    args = parser.parse_args()
    parent, child = mp.Pipe()
    mp.Process(target=serve_fake_workers, args=(child, args.step_s), daemon=True).start()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve_router(parent.recv(), args.grpc_port, args.http_port, args.stream_interval))


if __name__ == "__main__":
    main()
