"""Disaggregated pools of workers that span devices, through `tandem serve` on CPU (issue 18): a prefill worker
of 2 ranks handing its KV to a decode worker of 1, and one of 1 handing it to one of 2. Every rank sends or
receives the KV heads of its own cache (worker_host.rank_agents over kv_transfer.sharded, tcp here), so no rank
gathers another's heads. The greedy tokens must equal the engine's own on one device, and afterwards no block or
lease may be left held on any worker. The model: a tiny random-weight Llama written here, 4 query heads over 2
KV heads, so a rank of two holds one KV head. With the decode worker of two ranks, its rank 1 is then SIGKILLed
in the middle of a request: the request resumes with the same tokens or ends with a clear status, the controller
replaces the whole decode worker, and it serves the same tokens again with nothing left held. With the prefill
worker of two ranks, its rank 1 is SIGKILLed while idle: the controller replaces the whole prefill worker, which
then serves the same tokens.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from model_runtime.llm import LLM
from tandem_client import Client, Unavailable
from tests.e2e.cluster import ServeProcess
from tests.e2e.faults_support import Background, assert_all_idle, greedy, offline_engine, workers
from tests.e2e.test_tensor_parallel_serve import SHARP_INIT, rank_processes
from tests.model.tiny_models import write_tiny_hf
from tests.polling import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
NUM_BLOCKS = 64
PROMPTS = ["def add(a, b):", "The quick brown fox jumps over the lazy dog and keeps running", "class Engine:"]
MAX_TOKENS = 12
LONG = 120  # tokens of the request that the decode rank's death interrupts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf(tmp_path_factory.mktemp("tp-disagg"), "llama", initializer_range=SHARP_INIT)


@pytest.fixture(scope="module")
def offline(model_dir: Path) -> Iterator[LLM]:
    with offline_engine(NUM_BLOCKS, str(model_dir)) as llm:
        yield llm


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)])
def test_prefill_and_decode_of_different_sizes_serve_one_device_tokens(
    tmp_path: Path, model_dir: Path, offline: LLM, prefill_tp: int, decode_tp: int
) -> None:
    serve = ServeProcess(tmp_path, prefill=1, decode=1, model=str(model_dir), num_blocks=NUM_BLOCKS)
    config = yaml.safe_load(serve.config_path.read_text())
    config["prefill"]["engine"]["parallel"] = {"tensor_parallel_size": prefill_tp}
    config["decode"]["engine"]["parallel"] = {"tensor_parallel_size": decode_tp}
    serve.config_path.write_text(yaml.safe_dump(config))
    with serve:
        try:
            found = workers(serve.address)
            assert found["prefill-0"].devices == prefill_tp and found["decode-0"].devices == decode_tp
            assert len(rank_processes(serve)) == 1  # the one other rank, of whichever worker spans two
            check_greedy(serve.address, offline)
            assert_all_idle(serve.address)
            if decode_tp == 2:
                kill_a_decode_rank_mid_request(serve, offline)
            else:
                kill_a_prefill_rank(serve, offline)
            assert serve.stop() == 0
        finally:
            print("".join(serve.lines[-80:]))  # shown with a failing test


def check_greedy(address: str, offline: LLM) -> None:
    with Client(address) as client:
        for prompt in PROMPTS:
            got = client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, timeout=60)
            assert list(got.token_ids) == greedy(offline, prompt, MAX_TOKENS), prompt


def kill_a_decode_rank_mid_request(serve: ServeProcess, offline: LLM) -> None:
    (rank,) = rank_processes(serve)
    before = workers(serve.address)["decode-0"]
    prompt = "Tell me about foxes"
    request = Background(serve.address, prompt, max_tokens=LONG, temperature=0, ignore_eos=True)
    wait_until(lambda: request.num_tokens >= 8 or request.error, 60, "the request to be decoding")
    os.kill(rank.pid, signal.SIGKILL)
    request.join(120)
    if request.error is None:  # resumed on the replaced worker: the same tokens, none lost or repeated
        assert list(request.result.token_ids) == greedy(offline, prompt, LONG)
    else:
        assert isinstance(request.error, Unavailable), repr(request.error)
    wait_until(
        lambda: (w := workers(serve.address).get("decode-0")) and w.address != before.address,
        120,
        "the decode worker to be replaced",
    )
    wait_until(lambda: workers(serve.address)["decode-0"].state.name == "READY", 60, "the new decode worker")
    assert any("worker decode-0 restarting (1)" in line for line in serve.lines)
    check_greedy(serve.address, offline)
    assert_all_idle(serve.address)


def kill_a_prefill_rank(serve: ServeProcess, offline: LLM) -> None:
    (rank,) = rank_processes(serve)
    before = workers(serve.address)["prefill-0"]
    os.kill(rank.pid, signal.SIGKILL)
    wait_until(
        lambda: (w := workers(serve.address).get("prefill-0")) and w.address != before.address,
        120,
        "the prefill worker to be replaced",
    )
    wait_until(
        lambda: workers(serve.address)["prefill-0"].state.name == "READY", 60, "the new prefill worker"
    )
    assert any("worker prefill-0 restarting (1)" in line for line in serve.lines)
    check_greedy(serve.address, offline)
    assert_all_idle(serve.address)
