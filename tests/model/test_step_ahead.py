"""Step-ahead scheduling (scheduler.async_scheduling, model_runtime.step_ahead) on a tiny random Llama on the CPU:
an engine that schedules and launches step N+1 before step N's tokens reach the host gives the outputs of the
synchronous engine, token for token, through stop tokens, length limits, chunked prompts, preemption, the prefix
cache, seeded sampling with logprobs and aborts; it returns every block; and the places that cannot run it
refuse it by name. (On a CPU nothing overlaps: this checks correctness. The speed is measured on a GPU by
bench/offline_throughput.py.)"""

from __future__ import annotations

import time

import pytest

from deploy.config import ConfigError, parse_config
from model_runtime.config import CacheConfig, DeviceConfig, EngineConfig, SchedulerConfig
from model_runtime.engine import Engine
from model_runtime.request import SamplingParams
from model_runtime.request_rules import InvalidRequest
from tests.model.tiny_models import write_tiny_hf

PROMPTS = [[(7 * i + 3 * j) % 90 + 5 for i in range(5 + 9 * j)] for j in range(6)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_tiny_hf(tmp_path_factory.mktemp("step-ahead"), "llama"))


def _engine(
    path: str,
    ahead: bool,
    num_blocks: int = 256,
    prefix: bool = False,
    budget: int = 64,
    text: bool = False,
    kv_receiver: bool = False,
) -> Engine:
    return Engine(
        EngineConfig(
            model=path,
            cache=CacheConfig(block_size=4, num_blocks=num_blocks, enable_prefix_caching=prefix),
            scheduler=SchedulerConfig(
                max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=128, async_scheduling=ahead
            ),
            device=DeviceConfig(device="cpu", dtype="float32", enforce_eager=True),
        ),
        emit_text=text,
        kv_receiver=kv_receiver,
    )


def _run(
    engine: Engine, params: list[SamplingParams], abort_at: dict[int, str] | None = None, prompts=PROMPTS
) -> dict:
    """Every request's tokens, finish reason, logprobs and cached prompt tokens; `abort_at`: step -> request."""
    out: dict[str, dict] = {}
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
        out[f"r{i}"] = {"tokens": [], "finish": None, "logprobs": [], "cached": None, "text": ""}
    step = 0
    engine.preemptions = 0  # type: ignore[attr-defined]
    while engine.has_unfinished():
        if abort_at and step in abort_at:
            engine.abort(abort_at[step])
            out[abort_at[step]]["finish"] = "aborted"
        outputs = engine.step()
        engine.preemptions += engine.last_step.num_preempted if engine.last_step else 0  # type: ignore[attr-defined]
        for o in outputs:
            row = out[o.request_id]
            row["tokens"] += o.token_ids
            row["finish"] = o.finish_reason or row["finish"]
            row["logprobs"] += o.logprobs or []
            row["cached"] = o.num_cached_tokens
            row["text"] += o.text
        step += 1
        assert step < 2000
    return out


def _both(path: str, params: list[SamplingParams], **kw) -> tuple[dict, dict, Engine]:
    abort_at, prompts = kw.pop("abort_at", None), kw.pop("prompts", PROMPTS)
    sync = _run(_engine(path, False, **kw), params, abort_at, prompts)
    ahead_engine = _engine(path, True, **kw)
    ahead = _run(ahead_engine, params, abort_at, prompts)
    return sync, ahead, ahead_engine


def _all_blocks_back(engine: Engine) -> bool:
    return engine.pool.num_free == engine.pool.usable


def test_stop_tokens_and_length_limits_give_the_synchronous_outputs(tiny):
    free_run = _run(_engine(tiny, False), [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 6)
    # Each request stops at a token it would sample early on, so stops land mid-batch in different steps.
    params = [
        SamplingParams(
            temperature=0, max_tokens=5 + 3 * i, ignore_eos=True,
            stop_token_ids=(free_run[f"r{i}"]["tokens"][1 + i % 4],) if i % 3 else (),
        )
        for i in range(6)
    ]  # fmt: skip
    sync, ahead, engine = _both(tiny, params)
    assert ahead == sync
    assert {row["finish"] for row in sync.values()} == {"stop", "length"}
    assert engine.steps_ahead > 5  # the next step really was launched before the tokens came back
    assert _all_blocks_back(engine) and not engine.has_unfinished()


def test_text_stop_strings_eos_and_one_token_requests_give_the_synchronous_outputs(tiny):
    """With text on (the offline engine's OutputTracker): stop strings found in the detokenized text, the
    model's own end-of-sequence token, and requests whose first token is their last (max_tokens 1: held out of
    the step launched ahead of their prompt's)."""
    free_run = _run(
        _engine(tiny, False, text=True), [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)] * 6
    )
    params = []
    for i in range(6):
        text = free_run[f"r{i}"]["text"]
        stop = (text[len(text) // 2 : len(text) // 2 + 2],) if i % 2 and len(text) > 4 else ()
        params.append(SamplingParams(temperature=0, max_tokens=1 if i == 4 else 12, stop=stop))
    sync, ahead, engine = _both(tiny, params, text=True)
    assert ahead == sync
    assert "stop" in {row["finish"] for row in sync.values()} and len(sync["r4"]["tokens"]) == 1
    assert _all_blocks_back(engine)


def test_chunked_prompts_and_preemption_give_the_synchronous_outputs(tiny):
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * 6
    sync, ahead, engine = _both(tiny, params, num_blocks=40, budget=16)  # 16-token chunks; blocks run out
    assert ahead == sync
    assert engine.preemptions > 0 and engine.steps_ahead > 0  # type: ignore[attr-defined]
    assert engine.scheduler.num_running == 0 and _all_blocks_back(engine)


def test_seeded_sampling_with_logprobs_and_the_prefix_cache_give_the_synchronous_outputs(tiny):
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=9, ignore_eos=True, logprobs=2)
        for i in range(6)
    ]
    shared = PROMPTS[5][:24]  # six blocks of 4 tokens that every prompt starts with
    prompts = [shared + p[: 3 + i] for i, p in enumerate(PROMPTS)]
    sync, ahead, engine = _both(tiny, params, prefix=True, prompts=prompts, budget=32)
    assert ahead == sync
    assert any(row["cached"] for row in sync.values())  # later prompts share the earlier ones' prefix
    assert all(len(row["logprobs"]) == 9 for row in sync.values())
    assert _all_blocks_back(engine)


def test_an_abort_while_a_step_runs_ahead_gives_the_synchronous_outputs_and_returns_the_blocks(tiny):
    params = [SamplingParams(temperature=0, max_tokens=15, ignore_eos=True)] * 6
    sync, ahead, engine = _both(tiny, params, abort_at={4: "r2", 9: "r5"})
    assert ahead == sync
    assert sync["r2"]["finish"] == "aborted" and len(sync["r2"]["tokens"]) < 15
    assert _all_blocks_back(engine) and not engine.has_unfinished()


def test_the_engines_that_cannot_run_ahead_refuse_it_by_name(tiny):
    with pytest.raises(ValueError, match=r"scheduler\.async_scheduling: colocated and offline engines only"):
        Engine(
            EngineConfig(
                model=tiny,
                cache=CacheConfig(block_size=4, num_blocks=64),
                scheduler=SchedulerConfig(max_num_seqs=4, async_scheduling=True),
                device=DeviceConfig(device="cpu", dtype="float32"),
            ),
            prefill_only=True,
        )
    with pytest.raises(InvalidRequest, match=r"add_prefilled: .* must be built with kv_receiver=True"):
        _engine(tiny, True).add_prefilled("r", [5, 6, 7], SamplingParams(max_tokens=2), (1,), 9)
    with pytest.raises(ValueError, match=r"scheduler\.async_scheduling: must be true or false"):
        SchedulerConfig(async_scheduling="yes")  # type: ignore[arg-type]
    engine = {"scheduler": {"async_scheduling": True}}
    with pytest.raises(
        ConfigError, match=r"prefill\.engine\.scheduler\.async_scheduling: for colocated and decode workers"
    ):
        parse_config({"prefill": {"replicas": 1, "engine": engine}, "decode": {"replicas": 1}})
    spanning = {**engine, "parallel": {"tensor_parallel_size": 2}}
    with pytest.raises(ConfigError, match=r"decode\.engine\.scheduler\.async_scheduling: .* on one device"):
        parse_config({"prefill": {"replicas": 1}, "decode": {"replicas": 1, "engine": spanning}})
    parse_config({"colocated": {"replicas": 1, "engine": engine}})  # accepted there
    decode = parse_config({"prefill": {"replicas": 1}, "decode": {"replicas": 1, "engine": engine}}).decode
    assert decode.engine.scheduler.async_scheduling  # and on a decode worker (off unless set)


def test_colocated_and_decode_workers_on_one_device_run_ahead_unless_the_config_says_otherwise():
    def ahead(config: dict) -> dict[str, bool]:
        parsed = parse_config(config)
        pools = {"prefill": parsed.prefill, "decode": parsed.decode, "colocated": parsed.colocated}
        return {role: pool.engine.scheduler.async_scheduling for role, pool in pools.items()}

    assert ahead({"mode": "colocated", "colocated": {"replicas": 1}})["colocated"] is True
    assert ahead({"prefill": {"replicas": 1}, "decode": {"replicas": 1}}) == {
        "prefill": False, "decode": True, "colocated": True
    }  # fmt: skip
    off = {"scheduler": {"async_scheduling": False, "max_num_seqs": 8}}
    assert ahead({"mode": "colocated", "colocated": {"replicas": 1, "engine": off}})["colocated"] is False
    assert ahead({"prefill": {"replicas": 1}, "decode": {"replicas": 1, "engine": off}})["decode"] is False
    spanning = {"parallel": {"tensor_parallel_size": 2}}  # tensor-parallel ranks replay the lead's inputs
    assert (
        ahead({"mode": "colocated", "colocated": {"replicas": 1, "engine": spanning}})["colocated"] is False
    )
    assert (
        ahead({"prefill": {"replicas": 1}, "decode": {"replicas": 1, "engine": spanning}})["decode"] is False
    )


def test_behind_the_engine_loop_the_workers_path_gives_the_synchronous_outputs(tiny):
    """What a colocated worker runs: the EngineLoop thread steps the engine while requests arrive through
    call(); each subscriber gets its request's tokens and a finish, and the loop's step records add up."""
    import queue

    from model_runtime.engine_loop import EngineLoop

    params = [SamplingParams(temperature=0, max_tokens=6 + 2 * i, ignore_eos=True) for i in range(6)]
    results = []
    for ahead in (False, True):
        loop, records = EngineLoop(_engine(tiny, ahead)), []
        loop.add_step_listener(records.append)
        loop.start()
        outputs: queue.Queue = queue.Queue()
        try:
            for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
                loop.subscribe(f"r{i}", outputs.put)
                loop.call(lambda e, i=i, prompt=prompt, p=p: e.add_request(f"r{i}", prompt, p))
            tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(6)}
            finished = 0
            while finished < 6:
                out = outputs.get(timeout=30)
                tokens[out.request_id] += out.token_ids
                finished += out.finish_reason is not None
            # A step launched ahead for rows that finished meanwhile runs once more before the engine is idle.
            deadline = time.monotonic() + 10
            while not loop.call(lambda e: e.pool.num_free == e.pool.usable and not e.has_unfinished()):
                assert time.monotonic() < deadline, (
                    "the engine kept blocks or work after every request finished"
                )
                time.sleep(0.01)
        finally:
            loop.stop()
        assert sum(r.num_decode + r.num_prefill for r in records) >= sum(p.max_tokens for p in params)
        results.append(tokens)
    assert results[1] == results[0]


def _decode_run(engine: Engine, firsts: list[int], params: list[SamplingParams], watch: str | None = None):
    """A decode worker's path: each prompt's KV "lands" (blocks from the pool, filled by a prefill-only engine's
    computation being skipped: the same zeroed blocks for both engines) and is admitted with add_prefilled.
    Returns every request's tokens, and when `watch` is given, what the pool looked like when it finished: its
    blocks, the pool's free list and fenced count, and whether a step was then still in flight."""
    out, seen = {f"r{i}": [firsts[i]] for i in range(len(firsts))}, {}
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        blocks = engine.pool.allocate(-(-len(prompt) // 4))
        engine.add_prefilled(f"r{i}", prompt, p, tuple(blocks), firsts[i])
    while engine.has_unfinished():
        blocks = {}
        if watch is not None and watch not in seen:
            blocks = {r.request_id: list(r.block_ids) for r in engine.scheduler.running}
        for o in engine.step():
            out[o.request_id] += o.token_ids
            if o.request_id == watch and o.finish_reason is not None:
                free = set(engine.pool.free_block_ids())
                seen[watch] = (blocks[watch], free, engine.pool.num_fenced, engine.has_unfinished())
    return out, seen.get(watch)


def test_a_decode_workers_engine_runs_ahead_with_its_freed_blocks_fenced_until_the_step_in_flight_is_done(
    tiny,
):
    """Decode workers: the KV receiver writes landed blocks from its own streams, so a block freed while the step
    launched ahead may still use it (the wasted row of a request that just stopped writes its KV there) must not
    reach the free list, where the receiver would take it, before that step is done."""
    firsts = [11, 12, 13, 14, 15, 16]
    params = [SamplingParams(temperature=0, max_tokens=3 + 4 * i, ignore_eos=True) for i in range(6)]
    sync, _ = _decode_run(_engine(tiny, False), firsts, params)
    engine = _engine(tiny, True, kv_receiver=True)
    ahead, seen = _decode_run(engine, firsts, params, watch="r0")
    assert ahead == sync  # token for token
    assert [len(t) for t in ahead.values()] == [3 + 4 * i for i in range(6)]
    assert engine.steps_ahead > 0
    # r0 finished while the other five went on: its blocks were fenced, not free, while a step was in flight.
    blocks, free, fenced, in_flight = seen
    assert in_flight and fenced >= len(blocks) and not free & set(blocks)
    # Drained: nothing in flight, nothing fenced, every block back.
    assert engine.pool.fence is None and engine.pool.num_fenced == 0
    assert engine.pool.num_free == engine.pool.usable
    # Without the flag, a step-ahead engine refuses prefilled requests (above); a colocated engine frees at once.
    colocated = _engine(tiny, True)
    _run(colocated, params[:2])
    assert colocated.pool.fence is None and colocated.pool.num_fenced == 0
