"""The KV agents of a worker that spans several devices: every rank moves the KV heads of its own cache.

A tensor-parallel worker's ranks each hold some of the model's KV heads (model_runtime.kv_layout.KVShard), so
a handoff between a prefill worker of a ranks and a decode worker of b ranks is a set of transfers, each from
the prefill rank that holds some heads to the decode rank that holds them, GPU to GPU (kv_transfer.sharded).
Rank 0 is the worker's face: the router talks only to it. The other ranks run the engine's steps
(model_runtime.parallel.follower) and, beside that loop, an agent with its own KV sender or receiver:

    rank 0 (AgentHub)  <--- Unix socket in the ranks' private rendezvous directory --->  rank r (FollowerAgent)
                       AgentHello  <-  (its receiver's port, format, transports)
    decode:            AgentLease  ->  hold a lease over rank 0's block ids     <- AgentReply
    prefill:           AgentSend   ->  send your pieces of this request          (after the step that ran it)
    both:              AgentCancel ->  stop this request now
                       AgentOutcome <- the request's lease or sends ended here: nothing writes or reads its
                                       blocks on this rank any more

Blocks belong to rank 0 (its engine allocates and frees them; every rank's cache is addressed by the same ids),
so rank 0 frees a request's blocks only after every rank reported its outcome:

- Decode (ShardedReceiver): rank 0 reserves, then every other rank leases the same ids under a handle of rank
  0's choosing; the KVTarget lists every rank's lease. A request is admitted once every rank's lease landed.
  If any rank's lease fails, the others are cancelled, and the blocks go back once all have ended. Rank 0's
  lease is the clock: the other ranks' leases live until rank 0 ends them.
- Prefill (ShardedSender): once the prompt's first token is known, rank 0 sends its own pieces and tells every
  other rank to send its own, after the step that computed them. The transfer is done (and the blocks released)
  when every rank has reported.

Nothing received is unpickled: the agents speak protobuf (tandem.v1.rank_agent), KV travels as in every handoff.
"""

from __future__ import annotations

from worker_host.rank_agents.decode import ShardedReceiver
from worker_host.rank_agents.follower import FollowerAgent, StepClock
from worker_host.rank_agents.link import AgentHub, AgentLost
from worker_host.rank_agents.prefill import ShardedSender, ShardedSendHandle

__all__ = [
    "AgentHub",
    "AgentLost",
    "FollowerAgent",
    "ShardedReceiver",
    "ShardedSendHandle",
    "ShardedSender",
    "StepClock",
]
