"""router.processes (several router processes under `tandem serve`): the config's checks and each process's
ports, and the bench client's address lists. The processes themselves run in tests/e2e/test_router_processes.py."""

from __future__ import annotations

import pytest

from deploy.config import parse_config
from deploy.router_settings import RouterSettings
from model_runtime.config import ConfigError
from tandem_cli.bench.transports import servers


def test_process_i_serves_on_every_configured_port_plus_i_and_off_stays_off() -> None:
    settings = RouterSettings(port=50051, http_port=8000, metrics_port=9464, processes=3)
    assert settings.process_ports(0) == settings
    third = settings.process_ports(2)
    assert (third.port, third.http_port, third.metrics_port, third.processes) == (50053, 8002, 9466, 3)
    quiet = RouterSettings(port=50051, http_port=0, metrics_port=0, processes=2).process_ports(1)
    assert (quiet.port, quiet.http_port, quiet.metrics_port) == (50052, 0, 0)
    ephemeral = RouterSettings(port=0, http_port=0, metrics_port=0, processes=2).process_ports(1)
    assert ephemeral.port == 0  # each process binds a port of its own choosing and says which
    with pytest.raises(ValueError, match="there are 3"):
        settings.process_ports(3)


@pytest.mark.parametrize(
    ("router", "message"),
    [
        ({"processes": 0}, r"router\.processes: must be an integer in \[1, 64\], got 0"),
        ({"processes": "2"}, r"router\.processes: must be an integer"),
        ({"processes": 65}, r"router\.processes: must be an integer in \[1, 64\]"),
        (
            {"processes": 3, "port": 50051, "http_port": 50053, "metrics_port": 9464},
            r"router\.http_port: with router\.processes 3, router\.port and router\.http_port each take 3 "
            r"consecutive ports, and 50051 and 50053 overlap; space them at least 3 apart",
        ),
        (
            {"processes": 2, "port": 65535, "http_port": 0, "metrics_port": 0},
            r"router\.port: 2 router processes need ports 65535-65536, past 65535",
        ),
    ],
)
def test_bad_router_processes_settings_name_the_field(router: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"router": router})


def test_router_processes_with_standalone_routers_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"router\.processes: more than one with controller\.routers set"):
        parse_config({"router": {"processes": 2}, "controller": {"routers": ["router:50051"]}})
    assert parse_config({"router": {"processes": 4}}).router.processes == 4


def test_bench_server_lists() -> None:
    assert servers("127.0.0.1:1") == ["127.0.0.1:1"]
    assert servers("a:1, b:2") == ["a:1", "b:2"]
    with pytest.raises(ValueError, match="an empty address"):
        servers("a:1,,b:2")
