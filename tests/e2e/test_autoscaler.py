"""The SLO autoscaler on a real cluster: `tandem serve` (real Ray, real gRPC, the embedded model on CPU) with a
budget of 3 workers (each pool 1..2), started as 1 prefill + 2 decode under a decode-heavy load; the load shifts
to prefill-heavy and back, and the pools follow:

    decode-heavy  (short prompts, 16 tokens each):  TPOT misses, TTFT does not -> decode is at its max: stays
    prefill-heavy (300-token prompts, one token):   TTFT misses, no TPOT at all -> at the budget, decode gives
                                                                                  a worker: prefill 2, decode 1
    decode-heavy again                                                         -> prefill gives it back

No request fails across the two moves, each of which drains a worker under load.

Calibration (the 2-core CI box, 4 clients, p90 over 8 s windows, as the autoscaler logged them; decode-heavy
then had 8 tokens a request, now 16, which halves the prefill workers' share of it): decode-heavy TTFT
0.75-0.83 s and TPOT 0.24-0.29 s; prefill-heavy TTFT 4.6-8.2 s. The TTFT target (2 s) sits between the
phases with a margin of 2x on each side; the TPOT target (0.05 s) is 5x below any CPU decode step measured, and
prefill-heavy requests have no TPOT sample at all (one token), so each phase misses exactly one signal. The whole
test took 105-125 s there, most of it starting the cluster and the two workers.

Beside standalone routers (Kubernetes' layout, here on one host: `python -m deploy.router` and `tandem serve` with
controller.routers naming it), the controller asks the router over Admin.Status for its latency window and
decides from it (about 45 s).
"""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tandem_api.tandem.v1 import admin_pb2, admin_pb2_grpc
from tests.e2e.cluster import make_cluster
from tests.e2e.load import Load, RequestKind
from tests.loopback import free_port
from tests.polling import wait_until

pytestmark = pytest.mark.e2e

TTFT_TARGET_S = 2.0
TPOT_TARGET_S = 0.05
AUTOSCALER = {
    "enabled": True,
    "interval_s": 1.0,
    "window_s": 8.0,
    "min_requests": 3,
    "ttft_s": TTFT_TARGET_S,
    "tpot_s": TPOT_TARGET_S,
    "scale_up_patience": 2,
    "scale_down_patience": 1000,  # this test follows moves at the budget; shrinking is the unit tests' part
    # A pool gives a worker only if its load fits in one fewer (deploy.autoscaler.load; its unit tests check the
    # rule). Under 8-token decode-heavy requests the two prefill workers' busy share came near the default 0.6
    # for one worker (an estimate from the calibration below: the log did not show it then; blocked decisions now
    # say why), and once kept the worker from moving back for 90 s. Here the rule only has to let a pool give
    # what one worker can carry.
    "scale_down_utilization": 1.0,
    "cooldown_s": 2.0,
    "max_total_workers": 3,
    "prefill": {"min": 1, "max": 2},
    "decode": {"min": 1, "max": 2},
}
DECODE_HEAVY = RequestKind("decode_heavy", max_tokens=16)
PREFILL_HEAVY = RequestKind("prefill_heavy", max_tokens=1, prompt_tokens=300)
FOLLOW_S = 90  # one change: evidence (a few seconds), a worker's start on a loaded CPU, a drain


def status(address: str) -> admin_pb2.ClusterStatus:
    with grpc.insecure_channel(address) as channel:
        return admin_pb2_grpc.AdminStub(channel).Status(admin_pb2.StatusRequest(), timeout=5)


def settled_targets(address: str) -> dict[str, int] | None:
    """role -> target once every pool has reached it (nothing starting or draining); None before."""
    pools = status(address).pools
    if any(p.ready != p.target or p.starting or p.draining for p in pools):
        return None
    return {admin_pb2.WorkerRole.Name(p.role).removeprefix("WORKER_ROLE_").lower(): p.target for p in pools}


def decisions(metrics_address: str) -> dict[tuple[str, str, str], float]:
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {
        (s.labels["pool"], s.labels["direction"], s.labels["reason"]): s.value
        for family in text_string_to_metric_families(text)
        if family.name == "tandem_autoscaler_decisions"
        for s in family.samples
        if s.name.endswith("_total")
    }


CHANGE = re.compile(r"(prefill|decode) (\d+) -> (\d+) \((\w+)\)")


def changes_logged(lines: list[str]) -> list[list[str]]:
    """The changes of each autoscaler decision line that changed a target, in order."""
    return [
        [f"{pool} {a}->{b} {reason}" for pool, a, b, reason in CHANGE.findall(line)]
        for line in lines
        if "tandem.autoscaler: ttft p90" in line and CHANGE.search(line)
    ]


def test_the_pools_follow_a_load_that_shifts_from_decode_to_prefill_and_back(tmp_path) -> None:
    metrics_port = free_port()
    cluster = make_cluster(
        tmp_path,
        prefill=1,
        decode=2,
        num_blocks=512,
        metrics_port=metrics_port,
        extra={"autoscaler": AUTOSCALER},
    )
    with cluster as serve, Load(serve.address, clients=4, kind=DECODE_HEAVY) as load:
        address = serve.address

        def follow(expected: dict[str, int], what: str) -> None:
            wait_until(
                lambda: settled_targets(address) == expected,
                FOLLOW_S,
                what,
                lambda: (
                    f"{status(address).pools}\n{load.served} {load.errors[:3]}\n" + "".join(serve.lines[-15:])
                ),
                every_s=0.5,
            )

        metrics = f"127.0.0.1:{metrics_port}"
        # Decode-heavy: TPOT misses, but decode is at its max already: the autoscaler says so and changes nothing.
        wait_until(
            lambda: decisions(metrics).get(("decode", "blocked", "at_max")),
            60,
            "a blocked decode decision",
            lambda: "".join(serve.lines[-15:]),
            every_s=0.5,
        )
        assert settled_targets(address) == {"prefill": 1, "decode": 2}
        load.shift(PREFILL_HEAVY)
        follow({"prefill": 2, "decode": 1}, "a worker to move to prefill under prefill-heavy load")
        load.shift(DECODE_HEAVY)
        follow({"prefill": 1, "decode": 2}, "the worker to move back to decode")
        last = status(address).autoscaler  # what `tandem status` prints as "autoscaler: ..."
        counted = decisions(metrics)
    assert load.errors == [], load.errors[:5]
    assert load.served[PREFILL_HEAVY.name] > 0
    assert changes_logged(serve.lines) == [
        ["decode 2->1 moved", "prefill 1->2 ttft_miss"],
        ["prefill 2->1 moved", "decode 1->2 tpot_miss"],
    ], "".join(line for line in serve.lines if "autoscaler" in line)
    assert re.match(r"\d\d:\d\d:\d\d ttft p90 .* tpot p90 .*: (prefill|decode) ", last), last
    assert counted[("prefill", "up", "ttft_miss")] == counted[("decode", "up", "tpot_miss")] == 1
    assert counted[("decode", "down", "moved")] == counted[("prefill", "down", "moved")] == 1


@contextmanager
def standalone_router(config_path: Path) -> Iterator[None]:
    """`python -m deploy.router` (the Kubernetes router Deployment's command) on its config, until SIGTERM."""
    log = config_path.with_suffix(".log")
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deploy.router", "--config", str(config_path)], stdout=out, stderr=out
        )
    try:
        wait_until(
            lambda: "Tandem router serving" in log.read_text() or proc.poll() is not None,
            60,
            "the standalone router",
        )
        assert proc.poll() is None, log.read_text()
        yield
    finally:
        proc.terminate()
        proc.wait(30)


def test_beside_standalone_routers_the_controller_reads_their_latency_over_admin_status(tmp_path) -> None:
    """Kubernetes' layout on one host: a standalone router, and `tandem serve` with controller.routers naming it
    (it pushes membership there, runs no router, and serves only the autoscaler's counter on its metrics port)."""
    controller_metrics, router_metrics = free_port(), free_port()
    bounds = {
        "min": 1,
        "max": 1,
    }  # every persistent miss is blocked: the test watches what the controller reads
    autoscaler = {**AUTOSCALER, "prefill": bounds, "decode": bounds, "max_total_workers": 2}
    serve = make_cluster(
        tmp_path, prefill=1, decode=1, metrics_port=controller_metrics, extra={"autoscaler": autoscaler}
    )
    config = yaml.safe_load(serve.config_path.read_text())
    config["controller"]["routers"] = [serve.address]
    serve.config_path.write_text(yaml.safe_dump(config))
    router_config = tmp_path / "router.yaml"
    router_config.write_text(
        yaml.safe_dump({**config, "router": {**config["router"], "metrics_port": router_metrics}})
    )
    with standalone_router(router_config), serve, Load(serve.address, clients=3, kind=DECODE_HEAVY) as load:
        counted = wait_until(
            lambda: decisions(f"127.0.0.1:{controller_metrics}").get(("decode", "blocked", "at_max")),
            60,
            "the controller to see the router's TPOT miss",
            lambda: "".join(serve.lines[-15:]),
            every_s=0.5,
        )
        assert (
            "tandem_autoscaler_decisions_total"
            not in urllib.request.urlopen(f"http://127.0.0.1:{router_metrics}/metrics", timeout=5)
            .read()
            .decode()
        )
    assert counted >= 1 and load.errors == [], load.errors[:5]
    (line, *_) = [line for line in serve.lines if "decode stays 1 (at_max)" in line]
    requests = int(re.search(r"tpot p90 [\d.]+s \(target 0.05s, (\d+) requests\)", line).group(1))
    assert requests >= AUTOSCALER["min_requests"], line
