"""Scheduler: admission, chunked prefill, prefix hits, preemption, abort, the prefill/decode hooks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from model_runtime.block_pool import BlockPool
from model_runtime.config import SchedulerConfig
from model_runtime.request import Request, RequestStatus, SamplingParams, SchedulerOutput
from model_runtime.scheduler import RequestRejected, Scheduler

pytestmark = pytest.mark.unit

BS = 4


def make(
    num_blocks: int = 64, budget: int = 64, seqs: int = 8, max_model_len: int = 256, caching: bool = True
) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget)
    return Scheduler(cfg, BlockPool(num_blocks, BS, caching), BS, max_model_len)


def req(rid: str, prompt: list[int] | int, max_tokens: int = 4, arrival: float = 0.0) -> Request:
    tokens = list(range(prompt)) if isinstance(prompt, int) else prompt
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens), arrival_time=arrival)


def step(s: Scheduler, token: int = 7) -> SchedulerOutput:
    """One engine step with a fake model: every sampled chunk gets `token`; finish at the length cap."""
    out = s.schedule()
    s.advance(out)
    for chunk in out.chunks:
        if chunk.sample and s.get(chunk.request.request_id) is chunk.request:
            s.append_token(chunk.request, token)
            if chunk.request.num_tokens == s.token_cap(chunk.request):
                s.finish(chunk.request, RequestStatus.FINISHED_LENGTH)
    return out


def shape(out: SchedulerOutput) -> list[tuple[str, int, bool]]:
    return [(c.request.request_id, c.num_tokens, c.sample) for c in out.chunks]


def test_rejects_requests_that_can_never_fit() -> None:
    s = make(num_blocks=5, max_model_len=64)  # 4 usable blocks = 16 tokens
    with pytest.raises(RequestRejected, match="17 tokens = 5 blocks"):
        s.add(req("a", 10, max_tokens=7))
    s.add(req("b", 10, max_tokens=6))
    with pytest.raises(RequestRejected, match="already scheduled"):
        s.add(req("b", 3))
    with pytest.raises(RequestRejected, match="empty"):
        s.add(req("c", []))
    with pytest.raises(RequestRejected, match="non-negative"):
        s.add(req("d", [1, -2]))
    short = make(max_model_len=8)
    with pytest.raises(RequestRejected, match="at most 7 prompt tokens"):
        short.add(req("e", 8))
    short.add(req("f", 7, max_tokens=100))  # max_tokens is capped by max_model_len
    with pytest.raises(ValueError, match="block_size"):
        Scheduler(SchedulerConfig(), BlockPool(8, 8), BS, 64)


def test_chunked_prefill_splits_prompt_by_budget() -> None:
    s = make(budget=4)
    r = req("a", 10)
    s.add(r)
    assert shape(step(s)) == [("a", 4, False)]
    assert r.num_computed_tokens == 4 and len(r.block_ids) == 1
    assert shape(step(s)) == [("a", 4, False)]
    assert shape(step(s)) == [("a", 2, True)]
    assert r.num_computed_tokens == 10 and r.output_token_ids == [7] and len(r.block_ids) == 3


def test_decode_and_prefill_share_a_step_under_budget() -> None:
    s = make(budget=8)
    s.add(req("a", 3, max_tokens=10))
    assert shape(step(s)) == [("a", 3, True)]
    s.add(req("b", 20))
    assert shape(step(s)) == [("a", 1, True), ("b", 7, False)]
    assert shape(step(s)) == [("a", 1, True), ("b", 7, False)]
    assert shape(step(s)) == [("a", 1, True), ("b", 6, True)]
    assert shape(step(s)) == [("a", 1, True), ("b", 1, True)]


def test_max_num_seqs_limits_running() -> None:
    s = make(seqs=2)
    for rid in "abc":
        s.add(req(rid, 2, max_tokens=1 if rid == "a" else 3))
    assert [c.request.request_id for c in step(s).chunks] == ["a", "b"]
    assert s.num_running == 1 and s.num_waiting == 1  # a finished after its first token
    assert [c.request.request_id for c in step(s).chunks] == ["b", "c"]


def test_shared_prefix_reuses_blocks_while_both_run() -> None:
    s = make()
    a = req("a", list(range(10)), max_tokens=8)
    s.add(a)
    step(s)
    b = req("b", [*range(8), 50, 51, 52])
    s.add(b)
    out = step(s)
    assert shape(out) == [("a", 1, True), ("b", 3, True)]  # b computes only its 3 uncached tokens
    assert b.num_cached_tokens == 8
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert [s.pool.ref_count(x) for x in a.block_ids[:3]] == [2, 2, 1]


def test_fully_cached_prompt_still_computes_its_last_block() -> None:
    s = make()
    s.add(req("a", 8, max_tokens=1))
    step(s)
    b = req("b", 8)
    s.add(b)
    # Only full blocks before the last token match: block 1 is recomputed into a block of b's own.
    assert shape(step(s)) == [("b", 4, True)]
    assert b.num_cached_tokens == 4


def test_cached_freed_blocks_are_revived() -> None:
    s = make(num_blocks=9)
    a = req("a", 9, max_tokens=1)
    s.add(a)
    step(s)
    first_blocks = [int(x) for x in s.pool.free_block_ids() if s.pool.is_cached(x)]
    assert a.is_finished and s.pool.num_free == s.pool.usable and len(first_blocks) == 2
    b = req("b", 10)
    s.add(b)
    assert shape(step(s)) == [("b", 2, True)]
    assert sorted(b.block_ids[:2]) == sorted(first_blocks)
    assert s.pool.num_free == s.pool.usable - 3


def test_preemption_frees_the_last_admitted_and_resumes_by_recompute() -> None:
    s = make(num_blocks=5, caching=False)  # 4 usable blocks
    a, b = req("a", 7, max_tokens=9, arrival=1.0), req("b", 7, max_tokens=9, arrival=2.0)
    s.add(a)
    s.add(b)
    step(s, token=100)
    step(s, token=101)
    assert s.pool.num_free == 0 and b.output_token_ids == [100, 101]
    out = step(s, token=102)  # a needs a third block: b goes
    assert out.preempted == (b,) and shape(out) == [("a", 1, True)]
    assert b.status is RequestStatus.PREEMPTED and b.block_ids == [] and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and b.output_token_ids == [100, 101]
    while not a.is_finished:
        out = step(s, token=103)
        assert "b" not in [c.request.request_id for c in out.chunks]
    out = step(s, token=104)
    assert shape(out) == [("b", 9, True)]  # prompt + both outputs, from position 0
    assert b.output_token_ids == [100, 101, 104] and b.status is RequestStatus.RUNNING


def test_resume_uses_surviving_cached_blocks() -> None:
    s = make(num_blocks=5)
    a, b = req("a", 7, max_tokens=3, arrival=1.0), req("b", [9] * 7, max_tokens=9, arrival=2.0)
    s.add(a)
    s.add(b)
    step(s)
    step(s)
    assert step(s).preempted == (b,)  # a took b's tail block; b's head block stays cached
    assert a.is_finished
    assert shape(step(s)) == [("b", 5, True)]
    assert b.num_computed_tokens == 9 and b.num_cached_tokens == 0  # cached count is for first admission


def test_preempted_go_first_in_arrival_order_and_self_preemption() -> None:
    s = make(num_blocks=9, budget=64)
    r1, r2, r3 = (req(f"r{i}", 4, max_tokens=8, arrival=float(i)) for i in (1, 2, 3))
    for r in (r1, r2, r3):
        s.add(r)
    step(s)
    stolen = s.pool.allocate(s.pool.num_free)  # someone else (a KV handoff) holds the rest
    out = step(s)
    assert out.preempted == (r3, r2)  # r2 was then the last running request, so it preempted itself
    assert shape(out) == [("r1", 1, True)]
    s.add(req("w", 2, arrival=0.5))  # earlier arrival, but new requests wait behind preempted ones
    # r2's own freed block (plus r1's cached prompt block) lets r2 back in; r3 and w still wait.
    assert shape(step(s)) == [("r1", 1, True), ("r2", 1, True)]
    s.pool.free(stolen)
    assert [c.request.request_id for c in step(s).chunks] == ["r1", "r2", "r3", "w"]


def test_abort_frees_blocks_and_is_safe_mid_step() -> None:
    s = make()
    a, b = req("a", 6), req("b", 6)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert s.abort("a") is a
    s.advance(out)  # a's chunk is skipped
    assert a.status is RequestStatus.FINISHED_ABORTED and a.block_ids == [] and a.num_computed_tokens == 0
    assert b.num_computed_tokens == 6
    assert s.abort("a") is None and s.abort("nope") is None
    s.add(c := req("c", 3))
    assert s.abort("c") is c and s.num_waiting == 0
    s.abort("b")
    assert not s.has_unfinished() and s.pool.num_free == s.pool.usable


def test_call_order_is_enforced() -> None:
    s = make()
    r = req("a", 3, max_tokens=2)
    s.add(r)
    out = s.schedule()
    with pytest.raises(RuntimeError, match="advance"):
        s.schedule()
    with pytest.raises(ValueError, match="call advance"):
        s.append_token(r, 1)
    s.advance(out)
    with pytest.raises(RuntimeError, match="advanced already"):
        s.advance(out)
    with pytest.raises(RuntimeError, match="append_token, finish or detach"):
        s.schedule()
    s.append_token(r, 1)
    step(s)
    assert r.status is RequestStatus.FINISHED_LENGTH
    with pytest.raises(ValueError, match="not owned"):
        s.append_token(r, 1)
    with pytest.raises(ValueError, match="FINISHED_"):
        s.finish(r, RequestStatus.RUNNING)


def test_append_beyond_cap_is_refused() -> None:
    s = make()
    r = req("a", 3, max_tokens=1)
    s.add(r)
    out = s.schedule()
    s.advance(out)
    s.append_token(r, 5)
    s.advance(o := s.schedule())
    with pytest.raises(ValueError, match="must finish it"):
        s.append_token(r, 6)
    assert o.chunks[0].num_tokens == 1


def test_prefill_detach_then_decode_add_running() -> None:
    prefill = make(num_blocks=16, budget=4)
    decode = make(num_blocks=32, seqs=1)
    r = req("a", 10, max_tokens=3)
    prefill.add(r)
    while not step_no_finish(prefill).chunks[-1].sample:
        pass
    prefill.detach(r)
    assert not prefill.has_unfinished() and prefill.pool.num_used == 3 and prefill.schedule().is_empty
    # Ship: the decode side reserved blocks for the prompt; the first token came with the KV.
    shipped = Request(r.request_id, r.prompt_token_ids, r.sampling, status=RequestStatus.WAITING_FOR_KV)
    shipped.block_ids = decode.pool.allocate(3)
    shipped.output_token_ids = list(r.output_token_ids)
    shipped.num_computed_tokens = 10
    prefill.pool.free(r.block_ids)
    assert prefill.pool.num_free == prefill.pool.usable
    decode.add(other := req("x", 2, max_tokens=2))
    assert shape(step(decode)) == [("x", 2, True)]
    decode.add_running(shipped)
    assert shape(step(decode)) == [("x", 1, True)]  # one sequence slot: the landed request waits for it
    assert shipped.status is RequestStatus.WAITING_FOR_KV and other.is_finished
    assert shape(step(decode)) == [("a", 1, True)]  # decodes at position 11, right after the shipped KV
    assert shipped.status is RequestStatus.RUNNING
    step(decode)
    assert shipped.is_finished and shipped.num_tokens == 13
    assert decode.pool.num_free == decode.pool.usable


def test_a_landed_prompt_enters_the_prefix_cache_only_after_its_first_step() -> None:
    """add_running defers hashing the prompt's blocks (the decode worker's admission is on the path of the
    request's second token) to the schedule() after the request's first step, and then registers them all."""
    s = make(num_blocks=32)
    prompt = list(range(10, 22))  # 3 full blocks of 4
    landed = Request("a", prompt, SamplingParams(max_tokens=8), status=RequestStatus.WAITING_FOR_KV)
    landed.block_ids = s.pool.allocate(4)
    landed.output_token_ids = [5]
    landed.num_computed_tokens = len(prompt)
    s.add_running(landed)
    hashes = s.pool.hash_blocks(prompt)
    assert s.pool.cached_prefix_blocks(hashes) == 0
    assert shape(step(s)) == [("a", 1, True)]  # its first step: nothing hashed yet
    assert s.pool.cached_prefix_blocks(hashes) == 0
    step(s)  # the next schedule() registers every full block it holds
    assert s.pool.cached_prefix_blocks(hashes) == 3
    assert s.pool.cached_prefix_blocks(s.pool.hash_blocks(landed.all_token_ids)) == 3
    aborted = Request(
        "b", list(range(40, 52)), SamplingParams(max_tokens=8), status=RequestStatus.WAITING_FOR_KV
    )
    aborted.block_ids = s.pool.allocate(4)
    aborted.output_token_ids = [5]
    aborted.num_computed_tokens = 12
    s.add_running(aborted)
    s.abort("b")  # gone before its commit: nothing of it is registered, its blocks are free
    step(s)
    step(s)
    assert s.pool.cached_prefix_blocks(s.pool.hash_blocks(list(range(40, 52)))) == 0


def step_no_finish(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    s.advance(out)
    for chunk in out.chunks:
        if chunk.sample:
            s.append_token(chunk.request, 1)
    return out


def test_add_running_validates_its_request() -> None:
    s = make(num_blocks=8)
    r = req("a", 8)
    r.output_token_ids = [3]
    r.num_computed_tokens = 8
    with pytest.raises(RequestRejected, match="2 needed"):
        s.add_running(r)
    r.block_ids = [1, 2]
    with pytest.raises(RequestRejected, match="not allocated"):
        s.add_running(r)
    r.block_ids = s.pool.allocate(2)
    r.num_computed_tokens = 7
    with pytest.raises(RequestRejected, match="all tokens but the last"):
        s.add_running(r)
    with pytest.raises(RequestRejected, match="add_running"):
        s.add(r)


# --- random workloads ----------------------------------------------------------------------------------
class FakeModel:
    """Plays the model runner on a simulated paged cache, slot -> token written there.

    Before a chunk runs, every earlier position of its sequence must read back its own token through the block
    table (so shared and revived blocks hold the right prefix), and every block it writes must be its alone.
    """

    def __init__(self, pool: BlockPool) -> None:
        self.pool, self.bs = pool, pool.block_size
        self.slots: dict[tuple[int, int], int] = {}

    def run(self, out: SchedulerOutput) -> None:
        for chunk in out.chunks:
            r, bs = chunk.request, self.bs
            tokens, start = r.all_token_ids, r.num_computed_tokens
            end = start + chunk.num_tokens
            assert len(r.block_ids) >= -(-end // bs) and 0 not in r.block_ids
            assert len(set(r.block_ids)) == len(r.block_ids)
            for p in range(start):
                assert self.slots.get((r.block_ids[p // bs], p % bs)) == tokens[p]
            for p in range(start, end):
                assert self.pool.ref_count(r.block_ids[p // bs]) == 1
                self.slots[(r.block_ids[p // bs], p % bs)] = tokens[p]


BASES = [list(range(40)), list(range(40)), [i % 3 for i in range(40)]]  # two equal bases: shared prefixes
specs_strategy = st.lists(
    st.tuples(
        st.integers(1, 30), st.integers(1, 12), st.integers(0, 2), st.integers(0, 15), st.integers(0, 60)
    ),
    min_size=2,
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(
    specs=specs_strategy,
    spare_blocks=st.integers(-2, 5),
    bs=st.sampled_from([1, 2, 4]),
    budget=st.integers(1, 20),
    seqs=st.integers(1, 5),
    max_model_len=st.integers(12, 40),
    caching=st.booleans(),
)
def test_random_workloads_always_finish_with_all_blocks_free(
    specs: list[tuple[int, int, int, int, int]],
    spare_blocks: int,
    bs: int,
    budget: int,
    seqs: int,
    max_model_len: int,
    caching: bool,
) -> None:
    # About one max_model_len sequence of blocks, give or take: tight enough to preempt, some requests rejected.
    pool = BlockPool(max(2, -(-max_model_len // bs) + 1 + spare_blocks), bs, caching)
    s = Scheduler(SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget), pool, bs, max_model_len)
    model, accepted = FakeModel(pool), []
    for step_no in range(5000):
        for i, (plen, max_tokens, base, arrive_at, abort_at) in enumerate(specs):
            if arrive_at == step_no:
                r = req(str(i), BASES[base][:plen], max_tokens, arrival=float(i))
                cap = min(plen + max_tokens, max_model_len)
                if plen + 1 > max_model_len or -(-cap // bs) > pool.usable:
                    with pytest.raises(RequestRejected):
                        s.add(r)
                else:
                    s.add(r)
                    accepted.append(r)
            if abort_at == step_no:
                s.abort(str(i))
        if step_no > 15 and not s.has_unfinished():
            break
        had_work = s.has_unfinished()
        out = s.schedule()
        assert out.is_empty != had_work  # progress: every step with work left runs something
        assert out.num_tokens <= budget and len(out.chunks) <= seqs
        assert len({c.request.request_id for c in out.chunks}) == len(out.chunks)
        model.run(out)
        s.advance(out)
        for chunk in out.chunks:
            if chunk.sample:
                r = chunk.request
                s.append_token(r, (r.num_tokens * 31 + int(r.request_id)) % 3)
                if r.num_tokens == s.token_cap(r):
                    s.finish(r, RequestStatus.FINISHED_LENGTH)
                elif r.output_token_ids[-1] == 2 and int(r.request_id) % 2 == 0:
                    s.finish(r, RequestStatus.FINISHED_STOPPED)
        check_ownership(pool, [r for r in accepted if not r.is_finished])
    else:
        pytest.fail("the workload did not finish within 5000 steps")
    assert all(r.is_finished and r.block_ids == [] for r in accepted)
    assert pool.num_free == pool.usable


def check_ownership(pool: BlockPool, live: list[Request]) -> None:
    """Every reference the pool counts belongs to exactly one live request's block table, and vice versa."""
    assert pool.num_free + pool.num_used == pool.usable
    for block in range(1, pool.num_blocks):
        assert pool.ref_count(block) == sum(r.block_ids.count(block) for r in live)
    for r in live:
        if r.status is not RequestStatus.RUNNING:
            assert r.block_ids == [] and r.num_computed_tokens == 0
