"""transfer.kinds and its older spelling transfer.kind: what a deploy config may say, and the errors."""

from __future__ import annotations

import pytest

from deploy.config import parse_config
from kv_transfer import TransferConfig
from model_runtime.config import ConfigError, dataclass_from_dict

pytestmark = pytest.mark.unit


def test_kind_is_a_one_element_kinds_and_tcp_the_default() -> None:
    assert (TransferConfig().kinds, TransferConfig().kind) == (("tcp",), "tcp")
    assert TransferConfig(kind="nccl").kinds == ("nccl",)
    both = TransferConfig(kinds=["cuda_ipc"])
    assert (both.kinds, both.kind) == (("cuda_ipc",), "cuda_ipc")
    assert TransferConfig(kind="nccl", kinds=("nccl",)).kinds == ("nccl",)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"kinds": "tcp"}, r"transfer\.kinds: must be a non-empty list of tcp, nccl, cuda_ipc, got 'tcp'"),
        ({"kinds": []}, r"transfer\.kinds: must be a non-empty list"),
        ({"kinds": ["rdma"]}, r"transfer\.kinds: each entry must be one of tcp, nccl, cuda_ipc, got 'rdma'"),
        ({"kinds": ["tcp", "tcp"]}, r"transfer\.kinds: names a transport twice"),
        ({"kinds": ["cuda_ipc", "nccl", "tcp"]}, r"transfer\.kinds: one transport per deployment for now"),
        ({"kind": "rdma"}, r"transfer\.kind: must be one of tcp, nccl, cuda_ipc, got 'rdma'"),
        (
            {"kind": "tcp", "kinds": ["nccl"]},
            r"transfer\.kind: 'tcp' disagrees with transfer\.kinds \['nccl'\]",
        ),
    ],
)
def test_errors_name_the_field(data: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        dataclass_from_dict(TransferConfig, data, "transfer")


def test_a_deploy_config_takes_either_spelling() -> None:
    for transfer in ({"kind": "tcp"}, {"kinds": ["tcp"]}):
        config = parse_config({"mode": "disaggregated", "transfer": transfer})
        assert (config.transfer.kinds, config.transfer.kind) == (("tcp",), "tcp")
    with pytest.raises(ConfigError, match=r"^transfer\.kinds: "):
        parse_config({"mode": "disaggregated", "transfer": {"kinds": ["nccl", "tcp"]}})
