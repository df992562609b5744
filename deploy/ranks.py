"""A worker that spans several devices (`<pool>.engine.parallel.tensor_parallel_size` N > 1): N Ray actors in one
placement group (STRICT_PACK: one node, all or nothing), one per rank.

    controller   placement_group([bundle] * N, STRICT_PACK); the worker's actor (deploy.actors.WorkerProcess) in
                 bundle 0, started with the group
    rank 0       makes the rendezvous (a file store in a private directory: the ranks share one node, and
                 nothing listens on the network), starts ranks 1..N-1 (RankProcess) in bundles
                 1..N-1, joins them (model_runtime.parallel.group.init_tp_group), then builds its worker with
                 the group: it is the worker's face (gRPC, status, metrics), it schedules and samples
    rank r > 0   run_follower: its share of the weights and KV cache, running the steps rank 0 publishes; in a
                 prefill or decode pool also a KV agent that sends or receives its own heads (rank 0's
                 AgentHub, listening in the rendezvous directory, drives it: worker_host.rank_agents)

Rank 0's actor creates the other ranks' actors, so it owns them: Ray ends them when it ends (the controller kills
only rank 0, then removes the placement group). A rank that dies fails rank 0's next collective, which ends its
engine loop: the heartbeat says so and the controller replaces the whole worker. Rank 0 also reports a
finished rank as a dead loop (`ranks_alive`).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import TYPE_CHECKING, Any

from model_runtime.config import EngineConfig
from model_runtime.roles import WorkerRole

if TYPE_CHECKING:
    from model_runtime.parallel.group import TPGroup
    from worker_host.rank_agents import AgentHub
    from worker_host.spec import WorkerSpec

log = logging.getLogger(__name__)
CPU_BUNDLE = 0.01  # a placement group bundle may not be empty; CPU ranks ask for a sliver of a CPU each
GPU_RANK_CPUS = (
    1.0  # what Ray places a GPU actor with by default (num_cpus unset): each GPU rank's bundle holds it
)


def bundles(size: int, num_gpus: float, resources: dict[str, float]) -> list[dict[str, float]]:
    """One bundle per rank: its GPUs, one CPU (a GPU rank's actor asks Ray for one, as a one-device GPU worker
    does: a bundle without it cannot take the actor) and the pool's custom resources (one unit per device, as
    for one-device workers), or a sliver of CPU for a CPU rank."""
    if num_gpus > 0:
        bundle = {**resources, "GPU": float(num_gpus), "CPU": GPU_RANK_CPUS}
    else:
        bundle = {**resources, "CPU": CPU_BUNDLE}
    return [dict(bundle) for _ in range(size)]


def device_kind(engine: EngineConfig) -> str:
    """The collectives' device: "cuda" (Ray shows each rank its own GPU as device 0) or "cpu" (gloo)."""
    return "cuda" if engine.device.resolved_device().startswith("cuda") else "cpu"


class RankProcess:
    """Plain class; rank 0 wraps it with ray.remote(...) (this module imports without Ray)."""

    def __init__(self) -> None:
        from deploy.actors import GPU_SAFE_ENV

        os.environ.update(GPU_SAFE_ENV)

    def run(self, spec: WorkerSpec, rank: int, size: int, rendezvous: str) -> int:
        """Join the ranks and follow rank 0's steps until it stops them; returns the steps run. A prefill or
        decode rank also runs its KV agent beside the steps."""
        import torch

        from model_runtime.parallel.follower import build_follower, follow
        from model_runtime.parallel.group import close_tp_group, init_tp_group

        engine = spec.engine
        device = device_kind(engine)
        if device == "cpu":
            torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
        group = init_tp_group(
            rank, size, rendezvous, device, fast_all_reduce=engine.parallel.all_reduce == "auto"
        )
        agent = None
        try:
            runner = build_follower(engine, group)
            after_step = None
            if spec.role in (WorkerRole.PREFILL, WorkerRole.DECODE):
                agent, after_step = start_agent(spec, rank, runner, rendezvous)
            return follow(runner, group, after_step=after_step)
        finally:
            if agent is not None:
                agent.close()
            close_tp_group()


def start_agent(spec: WorkerSpec, rank: int, runner: Any, rendezvous: str) -> tuple[Any, Any]:
    """A prefill or decode rank's KV agent over its cache (started; it connects to rank 0's hub by itself), and
    the clock its step loop ticks."""
    from worker_host.rank_agents import FollowerAgent, StepClock

    cache = runner.runner.kv_cache
    clock = StepClock(cache.device)
    tls = spec.tls
    agent = FollowerAgent(
        spec.role.value,
        rank,
        runner.layout,
        cache,
        spec.transfer,
        rendezvous_directory(rendezvous),
        clock,
        server_tls=tls.ssl_context() if tls is not None else None,
        client_tls=tls.member_client_context() if tls is not None else None,
    )
    agent.start()
    return agent, clock.tick


def rendezvous_directory(rendezvous: str) -> str:
    return os.path.dirname(rendezvous.removeprefix("file://"))


class Ranks:
    """Rank 0's view of its worker's other ranks: started, joined, and watched."""

    def __init__(self) -> None:
        self.actors: list[Any] = []
        self.runs: list[Any] = []  # ObjectRef of each rank's run(): ready only when the rank stopped
        self._directory = ""
        self.hub: AgentHub | None = None  # a prefill or decode worker's: the other ranks' KV agents

    def start(self, spec: WorkerSpec, placement_group: Any, num_gpus: float) -> TPGroup:
        """Start ranks 1..N-1 in the group's bundles and join them as rank 0; blocks until all have joined."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from model_runtime.parallel.group import init_tp_group

        engine = spec.engine
        size = engine.parallel.tensor_parallel_size
        # STRICT_PACK puts every rank on this node: a file store here is their rendezvous. A TCP store would
        # listen on every interface, unauthenticated, for the group's whole life.
        self._directory = tempfile.mkdtemp(prefix="tandem-ranks-")
        rendezvous = f"file://{os.path.join(self._directory, 'store')}"
        if spec.role in (WorkerRole.PREFILL, WorkerRole.DECODE):
            from worker_host.rank_agents import AgentHub

            self.hub = AgentHub(self._directory, size - 1)  # listening before any rank can connect
        rank_class = ray.remote(RankProcess)
        for rank in range(1, size):
            options: dict[str, Any] = {
                "num_gpus": num_gpus,
                "max_restarts": 0,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group, placement_group_bundle_index=rank
                ),
            }
            if num_gpus == 0:
                options["num_cpus"] = 0
            actor: Any = rank_class.options(**options).remote()
            self.actors.append(actor)
            self.runs.append(actor.run.remote(spec, rank, size, rendezvous))
        if self.hub is not None:
            self.hub.ranks_alive = self.alive
        log.info("rank 0 waits for %d ranks at %s", size - 1, rendezvous)
        return init_tp_group(
            0, size, rendezvous, device_kind(engine), fast_all_reduce=engine.parallel.all_reduce == "auto"
        )

    def close(self) -> None:
        """Remove the rendezvous directory (the ranks end with rank 0's actor)."""
        if self.hub is not None:
            self.hub.close()
            self.hub = None
        if self._directory:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._directory = ""

    def alive(self) -> bool:
        """False once any other rank has stopped (its run() returned or raised)."""
        import ray

        if not self.runs:
            return True
        ready, _ = ray.wait(self.runs, num_returns=1, timeout=0)
        return not ready
