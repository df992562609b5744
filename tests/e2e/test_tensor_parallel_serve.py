"""A worker that spans two devices, through `tandem serve` (deploy.ranks): one colocated worker with
tensor_parallel_size 2 on CPU (gloo), i.e. two Ray actors in one placement group, rank 0 serving gRPC and rank 1
following its steps. Its greedy tokens equal the engine's own on one device (the model: a tiny random-weight
Llama written here, 4 query heads over 2 KV heads, so each rank holds 2 and 1). Then rank 1 is SIGKILLed in the
middle of a request: the request resumes on the replaced worker with the same tokens, or ends with a clear
status; the controller replaces the whole worker (both ranks, a new placement group), which serves the same
tokens again, and nothing is left held.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import yaml

from model_runtime.llm import LLM
from model_runtime.request import PromptInput, SamplingParams
from tandem_client import Client, Unavailable
from tests.e2e.cluster import ServeProcess
from tests.e2e.faults_support import (
    Background,
    assert_all_idle,
    assert_prompt_scores,
    greedy,
    offline_engine,
    workers,
)
from tests.model.tiny_models import write_tiny_hf
from tests.polling import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]
SHARP_INIT = 0.4  # large random weights: greedy picks are decisive, not ties that a reduction order flips
NUM_BLOCKS = 64
PROMPTS = ["def add(a, b):", "The quick brown fox", "class Engine:"]
MAX_TOKENS = 16
LONG = 120  # tokens of the request that rank 1's death interrupts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_hf(tmp_path_factory.mktemp("tp-serve"), "llama", initializer_range=SHARP_INIT)


@pytest.fixture(scope="module")
def offline(model_dir: Path) -> Iterator[LLM]:
    with offline_engine(NUM_BLOCKS, str(model_dir)) as llm:
        yield llm


@pytest.fixture
def cluster(tmp_path: Path, model_dir: Path) -> Iterator[ServeProcess]:
    # RAY_ADDRESS set (as a shell with a `ray start` cluster might have it): tandem serve, with no ray.address,
    # starts its own Ray all the same (nothing listens on port 9: joining would fail).
    serve = ServeProcess(
        tmp_path,
        prefill=0,
        decode=0,
        colocated=1,
        model=str(model_dir),
        num_blocks=NUM_BLOCKS,
        env={"RAY_ADDRESS": "127.0.0.1:9"},
    )
    config = yaml.safe_load(serve.config_path.read_text())
    config["colocated"]["engine"]["parallel"] = {"tensor_parallel_size": 2}
    serve.config_path.write_text(yaml.safe_dump(config))
    with serve:
        try:
            yield serve
        finally:
            print("".join(serve.lines[-80:]))  # shown with a failing test


def in_session(pid: int, serve: ServeProcess) -> bool:
    """Whether process `pid` belongs to this `tandem serve`'s session (it starts one; Ray and the workers inherit
    it); False for a process that has ended."""
    assert serve.proc is not None
    try:
        return os.getsid(pid) == serve.proc.pid
    except OSError:
        return False


def rank_processes(serve: ServeProcess) -> list[psutil.Process]:
    """The other ranks' processes of this `tandem serve` (Ray titles an actor's process `ray::RankProcess...`),
    found in its session: `make test` runs two groups of tests side by side, and a rank of the other group's
    cluster must not count here (it did: 2 == 1 with both tensor-parallel tests running at once)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if cmdline and cmdline[0].startswith("ray::RankProcess") and in_session(proc.pid, serve):
            found.append(proc)
    return found


def listening_off_loopback(serve: ServeProcess) -> list[str]:
    """Sockets that the serve process and every process of its session (Ray's, the workers', the ranks') listen
    on, other than loopback ones: a local cluster keeps all of its traffic on 127.0.0.1."""
    found = []
    for conn in psutil.net_connections("inet"):
        if conn.status != psutil.CONN_LISTEN or conn.pid is None or not in_session(conn.pid, serve):
            continue
        host = conn.laddr.ip.removeprefix("::ffff:")
        if not (host.startswith("127.") or host == "::1"):
            found.append(f"{psutil.Process(conn.pid).name()} {conn.pid} on {conn.laddr.ip}:{conn.laddr.port}")
    return found


def check_greedy(address: str, offline: LLM) -> None:
    with Client(address) as client:
        for prompt in PROMPTS:
            got = client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, timeout=60)
            assert list(got.token_ids) == greedy(offline, prompt, MAX_TOKENS), prompt


def check_prompt_scores(address: str, offline: LLM) -> None:
    """The colocated worker scores the prompt across both ranks (each holds half of lm_head's vocabulary):
    the one-device engine's prompt logprobs, with max_tokens 0."""
    with Client(address) as client:
        got = client.generate(PROMPTS[1], max_tokens=0, prompt_logprobs=3, timeout=60)
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3)
    (want,) = offline.generate([PromptInput(text=PROMPTS[1])], params)
    assert got.token_ids == () and got.usage.completion_tokens == 0
    assert_prompt_scores(got.prompt_logprobs, want.prompt_logprobs, PROMPTS[1])


def test_a_worker_of_two_ranks_serves_one_device_tokens_and_is_replaced_whole(
    cluster: ServeProcess, offline: LLM
) -> None:
    assert any("RAY_ADDRESS=127.0.0.1:9 is ignored" in line for line in cluster.lines)
    assert listening_off_loopback(cluster) == []
    check_greedy(cluster.address, offline)
    check_prompt_scores(cluster.address, offline)
    ranks = wait_until(lambda: rank_processes(cluster), 10, "rank 1's process")
    assert len(ranks) == 1, ranks
    before = workers(cluster.address)["colocated-0"]
    assert before.devices == 2  # what `tandem status` shows in its DEVICES column

    prompt = "Tell me about foxes"
    request = Background(cluster.address, prompt, max_tokens=LONG, temperature=0, ignore_eos=True)
    wait_until(lambda: request.num_tokens >= 8 or request.error, 60, "the request to be decoding")
    os.kill(ranks[0].pid, signal.SIGKILL)
    killed = time.monotonic()
    request.join(120)
    if request.error is None:  # resumed on the replaced worker: the same tokens, none lost or repeated
        assert list(request.result.token_ids) == greedy(offline, prompt, LONG)
    else:
        assert isinstance(request.error, Unavailable), repr(request.error)
    print(f"rank 1 killed; the request {'resumed' if request.error is None else 'failed cleanly'}")

    replaced = wait_until(
        lambda: (w := workers(cluster.address).get("colocated-0")) and w.address != before.address and w,
        120,
        "the worker to be replaced",
    )
    wait_until(lambda: workers(cluster.address)["colocated-0"].state.name == "READY", 60, "the new worker")
    print(f"replaced {time.monotonic() - killed:.1f} s after rank 1 died, now on {replaced.address}")
    assert any("worker colocated-0 restarting (1)" in line for line in cluster.lines)
    new_ranks = wait_until(lambda: rank_processes(cluster), 10, "the new rank 1")
    assert [p.pid for p in new_ranks] != [ranks[0].pid] and len(new_ranks) == 1, new_ranks
    check_greedy(cluster.address, offline)
    assert_all_idle(cluster.address)
    assert cluster.stop() == 0
    wait_until(lambda: not rank_processes(cluster), 20, "rank 1 to end with its worker")
