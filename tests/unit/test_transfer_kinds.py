"""transfer.kinds and its older spelling transfer.kind: what a deploy config may say, the errors, and which of them a
worker holds (kv_transfer.transport.held_kinds: the allowed ones its device can use)."""

from __future__ import annotations

import pytest
import torch

from deploy.config import parse_config
from kv_transfer import TransferConfig
from kv_transfer.transport import held_kinds
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
    config = parse_config({"mode": "disaggregated", "transfer": {"kinds": ["cuda_ipc", "nccl", "tcp"]}})
    assert (config.transfer.kinds, config.transfer.kind) == (("cuda_ipc", "nccl", "tcp"), "cuda_ipc")


def test_a_cpu_worker_holds_the_allowed_transports_it_can_use() -> None:
    cache = torch.zeros(2)
    assert held_kinds(TransferConfig(kinds=["cuda_ipc", "nccl", "tcp"]), cache) == ("tcp",)
    assert held_kinds(TransferConfig(kinds=["tcp"]), cache) == ("tcp",)
    with pytest.raises(
        ConfigError, match=r"transfer\.kinds: none of \['nccl', 'cuda_ipc'\] works with a KV cache on cpu"
    ):
        held_kinds(TransferConfig(kinds=["nccl", "cuda_ipc"]), cache)
