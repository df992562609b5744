"""Fixed worker metrics ports: the pool setting, its validation, its way into WorkerSpec, and a real worker metrics
server on a fixed port (served there; a second worker on a taken port fails with an error that says what to do)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest

from deploy.config import PoolSettings, parse_config
from deploy.slots import worker_spec
from model_runtime.config import ConfigError
from model_runtime.engine_loop import EngineLoop
from tests.loopback import consecutive_free_ports
from tests.unit.metrics_support import running_worker, scrape
from worker_host.metrics import MetricsPortInUse, WorkerMetrics, metrics_ports
from worker_host.spec import WorkerSpec

pytestmark = pytest.mark.unit


# --- config ----------------------------------------------------------------------------------------------
def test_pools_default_to_an_ephemeral_metrics_port() -> None:
    config = parse_config({})
    assert (config.prefill.metrics_port, config.prefill.metrics_port_count) == (0, 1)
    assert PoolSettings().metrics_port == 0


def test_a_fixed_metrics_port_and_count_load_and_reach_the_worker_spec() -> None:
    config = parse_config(
        {"prefill": {"metrics_port": 9465, "metrics_port_count": 4}, "ray": {"address": "auto"}}
    )
    assert (config.prefill.metrics_port, config.prefill.metrics_port_count) == (9465, 4)
    spec = worker_spec(config, "prefill", 2)
    assert (spec.worker_id, spec.metrics_port, spec.metrics_port_count) == ("prefill-2", 9465, 4)
    assert spec.host == "0.0.0.0"
    decode = worker_spec(config, "decode", 0)
    assert (decode.metrics_port, decode.metrics_port_count) == (0, 1)


@pytest.mark.parametrize(
    ("pool", "message"),
    [
        ({"metrics_port": 65536}, "decode.metrics_port: must be an integer in [0, 65535]"),
        ({"metrics_port": -1}, "decode.metrics_port: must be an integer in [0, 65535]"),
        ({"metrics_port": "9465"}, "decode.metrics_port: must be an integer"),
        ({"metrics_port": True}, "decode.metrics_port: must be an integer"),
        ({"metrics_port_count": 0}, "decode.metrics_port_count: must be an integer >= 1"),
        ({"metrics_port": 65535, "metrics_port_count": 2}, "decode.metrics_port_count: ports 65535..65536"),
        ({"metrics_prot": 9465}, "decode.metrics_prot: unknown key"),
    ],
)
def test_bad_metrics_ports_are_config_errors_naming_the_key(pool: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"decode": pool})
    assert message in str(err.value)


def test_the_port_range_a_worker_may_take() -> None:
    spec = WorkerSpec(worker_id="decode-0", role="decode", engine=PoolSettings().engine)
    assert list(metrics_ports(spec)) == [0]
    fixed = WorkerSpec(
        worker_id="decode-0", role="decode", engine=spec.engine, metrics_port=9465, metrics_port_count=3
    )
    assert list(metrics_ports(fixed)) == [9465, 9466, 9467]


# --- a real worker metrics server --------------------------------------------------------------------------
@contextmanager
def metrics_on(loop: EngineLoop, worker_id: str, port: int, count: int = 1) -> Iterator[WorkerMetrics]:
    engine = loop.engine.config
    spec = WorkerSpec(worker_id, "decode", engine, metrics_port=port, metrics_port_count=count)
    metrics = WorkerMetrics(spec, loop)
    try:
        yield metrics
    finally:
        metrics.stop()


def test_a_worker_serves_metrics_on_its_fixed_port_and_a_second_one_there_fails_clearly(
    tmp_path: Path,
) -> None:
    port = consecutive_free_ports(1)
    with running_worker(tmp_path, "decode") as w:
        with metrics_on(w.loop, "decode-0", port) as first, metrics_on(w.loop, "decode-1", port) as second:
            assert first.start() == f"127.0.0.1:{port}"
            assert 'tandem_worker_up{model="' in scrape(f"127.0.0.1:{port}")
            with pytest.raises(MetricsPortInUse) as err:
                second.start()
            message = str(err.value)
            for part in ("worker decode-1", f"metrics port {port}", "decode.metrics_port: 0", "one worker"):
                assert part in message, message
            assert second.address == ""
        # Stopped, the port is free again for the worker that replaces it.
        with metrics_on(w.loop, "decode-0", port) as replacement:
            assert replacement.start() == f"127.0.0.1:{port}"


def test_workers_sharing_a_node_take_the_next_free_port_of_the_range(tmp_path: Path) -> None:
    port = consecutive_free_ports(2)
    with running_worker(tmp_path, "decode") as w, ExitStack() as stack:
        workers = [stack.enter_context(metrics_on(w.loop, f"decode-{i}", port, count=2)) for i in range(3)]
        assert [m.start() for m in workers[:2]] == [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]
        assert "tandem_kv_cache_total_blocks" in scrape(f"127.0.0.1:{port + 1}")
        with pytest.raises(MetricsPortInUse) as err:
            workers[2].start()
        assert f"worker decode-2: metrics ports {port}-{port + 1} on 127.0.0.1 are all in use" in str(
            err.value
        )
        assert "raise decode.metrics_port_count" in str(err.value)
