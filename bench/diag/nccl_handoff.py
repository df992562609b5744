"""One nccl handoff between two processes with timing prints: a quick diagnosis on a 2-GPU machine."""

from __future__ import annotations

import sys
import time

sys.path.insert(0, ".")
import tests.gpu.test_kv_transfer_gpu as t
from kv_transfer import KVReceiver


def main() -> None:
    import faulthandler

    faulthandler.dump_traceback_later(36, exit=False)  # where the receiver's threads are stuck, if they are
    kind = sys.argv[1] if len(sys.argv) > 1 else "nccl"
    conn, proc = t.spawn(t._sender_peer, kind, "cuda:1")
    cache, alloc = t.make_cache(99, "cuda:0"), t.FreeList(16)
    with KVReceiver(t.layout_of(), cache, alloc, t.config(kind)) as receiver:
        lease = receiver.reserve("diag", 16)
        start = time.monotonic()
        conn.send(t.command(receiver, lease, "all"))
        for _ in range(400):
            results = receiver.poll()
            if results:
                print("receiver result after", time.monotonic() - start, results, flush=True)
                break
            if conn.poll(0):
                print("sender says", conn.recv(), "after", time.monotonic() - start, flush=True)
            time.sleep(0.1)
        else:
            print("no result in 40 s; stats:", receiver.stats(), flush=True)
        if conn.poll(5):
            print("sender says", conn.recv(), flush=True)
    conn.send(None)
    proc.join(5)
    proc.kill()


if __name__ == "__main__":
    main()
