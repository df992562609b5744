"""Engine: one model, one KV cache, continuous batching. The colocated engine, and the core both workers run.

    engine = Engine(EngineConfig(model="smollm2-135m-instruct"))
    engine.add_request("r1", prompt_ids, SamplingParams(temperature=0, max_tokens=32))
    while engine.has_unfinished():
        for out in engine.step(): ...          # StepOutput: new token(s) and text delta per request

The scheduler decides which tokens run, the runner computes logits, the sampler picks tokens, and a tracker per
request applies the stop rules: an OutputTracker (text and stop strings) by default, a TokenTracker (token ids
only, `text` always "") with `emit_text=False`, which is how the workers run: the router owns text. With
`prefill_only=True` (the prefill worker) a request leaves the engine after its first sampled token with its
blocks still allocated, so its KV can be shipped; the owner frees them with `release_blocks`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from model_runtime.block_pool import BlockPool
from model_runtime.config import EngineConfig
from model_runtime.detokenizer import IncrementalDetokenizer
from model_runtime.layer_stream import LayerListener, LayerStreams
from model_runtime.output import OutputTracker, TokenRules, TokenTracker
from model_runtime.parallel.group import TPGroup
from model_runtime.request import Priority, Request, RequestStatus, SamplingParams, generated_tokens
from model_runtime.request_rules import InvalidRequest, RequestLimits
from model_runtime.runner_setup import build_runner
from model_runtime.sampler import PendingIds, Sampler, SamplerOutput, SamplingTensors, TokenLogprobs
from model_runtime.scheduler import Scheduler
from model_runtime.startup import StartupProgress
from model_runtime.step_ahead import AheadStepper
from model_runtime.step_record import StepRecord, first_tokens
from model_runtime.tokenizer import Tokenizer
from model_runtime.weights import load_model_config, resolve_model

log = logging.getLogger(__name__)


# Not frozen: one is built per sequence per step (512 a step at a large batch), and a frozen dataclass's
# __init__ (object.__setattr__ per field) costs about four times a plain one with slots. Nothing mutates it.
@dataclass(slots=True)
class StepOutput:
    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # prefill_only engines: the request's blocks, still allocated, and its prompt length.
    kv_block_ids: tuple[int, ...] = ()
    num_prompt_tokens: int = 0
    # Prompt tokens this engine took from its prefix cache for the request (on every output).
    num_cached_tokens: int = 0
    # sampling.prompt_logprobs: every prompt token's score, None for the first (its first output only)
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        prefill_only: bool = False,
        emit_text: bool = True,
        on_progress: Callable[[str], None] | None = None,
        tp_group: TPGroup | None = None,
        kv_receiver: bool = False,
    ) -> None:
        """`emit_text=False`: no detokenization and no stop strings on the engine thread (StepOutput.text is "");
        the token stop rules still apply. `on_progress(line)` follows the start-up: weights loaded, KV cache
        sized, CUDA graphs captured. `tp_group`: with parallel.tensor_parallel_size N > 1, the N ranks, of
        which this engine is the lead (rank 0: it schedules and samples; the others run
        model_runtime.parallel.follower.run_follower). Call `close()` when done to release them.
        `kv_receiver`: the pool's blocks are also written outside the engine's compute stream (a decode
        worker's KV receiver); with scheduler.async_scheduling the blocks freed while a step may still run are
        fenced until it is done (model_runtime.step_ahead)."""
        self.config = config
        self.prefill_only = prefill_only
        self.emit_text = emit_text
        self.device = config.device.resolved_device()
        dtype_name = config.device.resolved_dtype()
        progress = StartupProgress(on_progress)
        progress.phase(f"reading the model config and tokenizer of {config.model}")
        self.source = resolve_model(config.model)
        self.model_config = load_model_config(self.source)
        self.tokenizer = Tokenizer.from_source(self.source)
        rank = build_runner(config, self.source, self.model_config, progress, tp_group)
        self.runner, self.layout, self.max_model_len = rank.runner, rank.layout, rank.max_model_len
        self.tensor_parallel = rank.tensor_parallel
        mc, num_blocks = self.model_config, self.layout.num_blocks
        self.pool = BlockPool(num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.pool, config.cache.block_size, self.max_model_len)
        self.limits = RequestLimits(
            mc.vocab_size, self.max_model_len, config.cache.block_size, self.pool.usable
        )
        self.sampler = Sampler(self.device, seed=config.device.seed)
        self.eos_token_ids = tuple(sorted(set(mc.eos_token_ids) | set(self.tokenizer.eos_token_ids)))
        self._trackers: dict[str, OutputTracker | TokenTracker] = {}
        self._layer_streams = LayerStreams(self.pool, mc.num_layers, self.runner.kv_cache.device)
        self.requests_total = 0  # requests accepted (add_request / add_prefilled) since start
        self.last_step: StepRecord | None = None  # the last step(), None when it found nothing runnable
        # scheduler.async_scheduling: steps scheduled and launched ahead (model_runtime.step_ahead)
        self._ahead: AheadStepper | None = None
        if config.scheduler.async_scheduling:
            if prefill_only or self.tensor_parallel is not None:
                raise ValueError(
                    "scheduler.async_scheduling: colocated and offline engines only; a prefill worker ships its "
                    "blocks after one token and tensor-parallel ranks replay the lead's host inputs"
                )
            self._ahead = AheadStepper(
                self.scheduler,
                self.runner,
                self.pool,
                self._run_sampler,
                lambda request, token, lp: self._emit(request, token, lp, pending=True),
                config.scheduler.max_num_seqs,
                fence_frees=kv_receiver,
                late_launch=config.scheduler.late_launch,
                late_launch_margin_s=config.scheduler.late_launch_margin_s,
            )
        log.info(
            "engine ready: %s on %s (%s), %d KV blocks of %d tokens, max_model_len %d, steps %s",
            mc.name,
            self.device,
            dtype_name,
            num_blocks,
            config.cache.block_size,
            self.max_model_len,
            "scheduled ahead" if self._ahead is not None else "synchronous",
        )

    # --- requests --------------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        """Raise InvalidRequest naming the field when the request could never run here (request_rules)."""
        self.limits.check(prompt_token_ids, sampling)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        output_offset: int = 0,
        priority: Priority = Priority.INTERACTIVE,
        arrival_time: float | None = None,
    ) -> Request:
        """`output_offset`: see Request.output_offset (a resumed request; 0 for a new one). `priority`: its
        class among the waiting prompts (model_runtime.waiting). `arrival_time`: time.monotonic() when the
        request reached the worker (default now), so that its waiting time includes the wait for the engine
        thread."""
        self.validate(prompt_token_ids, sampling)
        _check_offset(output_offset)
        if output_offset and sampling.prompt_logprobs is not None:
            raise InvalidRequest(
                "prompt_logprobs: not for a resumed request (output_offset > 0): its prompt holds generated tokens"
            )
        if request_id in self._trackers:
            raise InvalidRequest(f"request_id: {request_id!r} is already running")
        request = Request(
            request_id,
            list(prompt_token_ids),
            sampling,
            eos_token_ids=self.eos_token_ids,
            output_offset=output_offset,
            priority=priority,
        )
        if arrival_time is not None:
            request.arrival_time = arrival_time
        self.scheduler.add(request)
        self._trackers[request_id] = self._tracker(request)
        self.requests_total += 1
        return request

    def _tracker(self, request: Request) -> OutputTracker | TokenTracker:
        if not self.emit_text:
            rules = TokenRules(
                request.sampling, self.eos_token_ids, self.max_model_len, request.num_prompt_tokens
            )
            return TokenTracker(rules)
        detok = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids)
        return OutputTracker(
            request.sampling, self.eos_token_ids, detok, self.max_model_len, request.num_prompt_tokens
        )

    def add_prefilled(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        block_ids: tuple[int, ...],
        first_token: int,
        first_logprob: TokenLogprobs | None = None,
        output_offset: int = 0,
        priority: Priority = Priority.INTERACTIVE,
    ) -> StepOutput | None:
        """Decode worker: admit a request whose prompt KV landed in `block_ids` (allocated from this pool and
        now owned by the engine) with the token prefill sampled. Returns a finished StepOutput when that token
        already ends the request (its blocks are freed), else None: later tokens come from step().
        `output_offset`: the output index prefill sampled `first_token` at (see Request.output_offset);
        `priority`: its class among the requests waiting for a sequence slot."""
        if self._ahead is not None and not self._ahead.fence_frees:  # the receiver's writes need the fence
            raise InvalidRequest(
                "add_prefilled: with scheduler.async_scheduling, a decode worker's engine must be built with "
                "kv_receiver=True"
            )
        self.validate(prompt_token_ids, sampling)
        _check_offset(output_offset)
        request = Request(
            request_id,
            list(prompt_token_ids),
            sampling,
            eos_token_ids=self.eos_token_ids,
            block_ids=list(block_ids),
            num_computed_tokens=len(prompt_token_ids),
            output_offset=output_offset,
            priority=priority,
        )
        request.prompt_logprobs, request.scoring_prompt = None, False  # the prefill worker scored the prompt
        request.output_token_ids.append(first_token)
        if first_logprob is not None:
            request.output_logprobs.append(first_logprob)
        tracker = self._tracker(request)
        verdict = tracker.on_token(first_token)
        if verdict.finished is not None:
            self.pool.free(list(block_ids))
            return StepOutput(
                request_id,
                [first_token],
                verdict.text_delta,
                None,
                verdict.finished.value,
                verdict.stop_reason,
            )
        request.status = RequestStatus.WAITING_FOR_KV
        self.scheduler.add_running(request)
        self.requests_total += 1
        self._trackers[request_id] = tracker
        return None

    def stream_layers(self, request_id: str, listener: LayerListener, groups: int) -> None:
        """Hand `request_id`'s KV to `listener` in `groups` layer groups while the step that completes its
        prompt runs (model_runtime.layer_stream); the request must be waiting or running."""
        if request_id not in self._trackers:
            raise InvalidRequest(f"request_id: {request_id!r} is not running here")
        self._layer_streams.add(request_id, listener, groups)

    def abort(self, request_id: str) -> bool:
        self._trackers.pop(request_id, None)
        self._layer_streams.drop(request_id)
        return self.scheduler.abort(request_id) is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or (self._ahead is not None and self._ahead.flight is not None)

    def release_blocks(self, block_ids: tuple[int, ...] | list[int]) -> None:
        """prefill_only: give back the blocks of a request whose KV has been shipped (or abandoned)."""
        self.pool.free(list(block_ids))

    # --- stepping --------------------------------------------------------------------------------------
    @property
    def last_step_ran(self) -> bool:
        """False when the last step() found nothing runnable (callers may back off)."""
        return self.last_step is not None

    @property
    def steps_ahead(self) -> int:
        """Steps scheduled and launched while the step before them ran (0 for a synchronous engine)."""
        return self._ahead.steps_ahead if self._ahead is not None else 0

    def step(self) -> list[StepOutput]:
        if self._ahead is not None:
            results, self.last_step = self._ahead.step()
            return results
        started = time.perf_counter()
        out = self.scheduler.schedule()
        if out.is_empty:
            self.last_step = None
            return []
        planned = StepRecord.planned(out)
        logits = self.runner.execute(out, layer_hook=self._layer_streams.hook_for(out))
        scores = self.runner.take_prompt_scores()
        sampled_chunks = [c for c in out.chunks if c.sample]
        tokens, logprobs = self._sample(logits, [c.request for c in sampled_chunks])
        if scores is not None:
            scores.store()
        self.scheduler.advance(out)
        results = []
        for chunk, token, lp in zip(sampled_chunks, tokens, logprobs):
            if chunk.request.is_finished:  # aborted while the step ran
                continue
            results.append(self._emit(chunk.request, token, lp))
        # A first token needs a prompt chunk in the step (a decode chunk belongs to a request with output), so a
        # decode-only step skips the walk.
        firsts = first_tokens(c.request for c in sampled_chunks) if planned.num_prefill else ()
        self.last_step = replace(planned, duration_s=time.perf_counter() - started, first_tokens=firsts)
        return results

    def set_late_launch(self, on: bool) -> bool:
        """Turn scheduler.late_launch on or off between steps (a benchmark's A/B on one engine); True when the
        engine can launch late at all (steps scheduled ahead, on a GPU). The clock starts without timings."""
        return self._ahead is not None and self._ahead.set_late_launch(on)

    def launch_clock_stats(self) -> tuple[int, int]:
        """(held, misses) of the launch clock: launches it timed for the serving loop, and those that found the
        GPU idle all the same (0, 0 without a clock)."""
        clock = self._ahead.clock if self._ahead is not None else None
        return (clock.held, clock.misses) if clock is not None else (0, 0)

    def launch_at(self) -> float | None:
        """time.perf_counter() at which a serving loop should call step() to launch the next step just before
        the one in flight ends (scheduler.late_launch, model_runtime.launch_clock); None: call it now."""
        return self._ahead.launch_at() if self._ahead is not None else None

    def _run_sampler(
        self, logits: torch.Tensor, requests: list[Request], pending: PendingIds | None = None
    ) -> SamplerOutput:
        """Row i samples requests[i]'s next output token (its index counts a pending one); nothing waits.
        `pending`: the pending tokens' ids on the device (step-ahead), which penalties count."""
        generated = prompts = None
        if any(r.sampling.penalized for r in requests):  # one attribute a row: the common case costs no more
            generated = [generated_tokens(r) if r.sampling.penalized else () for r in requests]
            if any(r.sampling.repetition_penalty != 1 for r in requests):
                prompts = [r.prompt_token_ids if r.sampling.repetition_penalty != 1 else () for r in requests]
        tensors = SamplingTensors.from_params(
            [r.sampling for r in requests],
            [r.output_offset + r.num_output_tokens for r in requests],
            self.model_config.vocab_size,
            logits.device,
            generated=generated,
            pending=pending if generated is not None else None,
            prompts=prompts,
        )
        return self.sampler(logits, tensors)

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], list]:
        if not requests:
            return [], []
        result = self._run_sampler(logits, requests)
        tokens = result.sampled_token_ids.tolist()
        lps = result.logprobs_lists() if result.logprobs is not None else [None] * len(tokens)
        return tokens, lps

    def _emit(
        self, request: Request, token: int, logprob: TokenLogprobs | None, pending: bool = False
    ) -> StepOutput:
        """`pending`: the token takes the place append_pending held for it (step-ahead)."""
        if pending:
            self.scheduler.resolve(request, token)
        else:
            self.scheduler.append_token(request, token)
        if logprob is not None:
            request.output_logprobs.append(logprob)
        tracker = self._trackers[request.request_id]
        verdict = tracker.on_token(token)
        lps = [logprob] if logprob is not None else None
        scores = None
        if request.scoring_prompt:  # its first output: the prompt's scores go with it
            scores, request.scoring_prompt = request.prompt_logprobs, False
        if verdict.finished is not None:
            self.scheduler.finish(request, verdict.finished)
            del self._trackers[request.request_id]
            return StepOutput(
                request.request_id,
                [token],
                verdict.text_delta,
                lps,
                verdict.finished.value,
                verdict.stop_reason,
                num_cached_tokens=request.num_cached_tokens,
                prompt_logprobs=scores,
            )
        if self.prefill_only:
            self.scheduler.detach(request)
            del self._trackers[request.request_id]
            return StepOutput(
                request.request_id,
                [token],
                verdict.text_delta,
                lps,
                kv_block_ids=tuple(request.block_ids),
                num_prompt_tokens=request.num_prompt_tokens,
                num_cached_tokens=request.num_cached_tokens,
                prompt_logprobs=scores,
            )
        return StepOutput(
            request.request_id,
            [token],
            verdict.text_delta,
            lps,
            num_cached_tokens=request.num_cached_tokens,
            prompt_logprobs=scores,
        )

    def close(self) -> None:
        """Release a tensor-parallel engine's other ranks from their step loop (nothing on one device; safe
        to call twice). No step may run afterwards."""
        if self.tensor_parallel is not None:
            self.tensor_parallel.stop_followers()

    # --- introspection ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def queued_prompt_tokens(self) -> int:
        """Prompt tokens not yet computed, over every request the scheduler holds (placement signal)."""
        return self.scheduler.uncomputed_prompt_tokens()


def _check_offset(output_offset: int) -> None:
    if not isinstance(output_offset, int) or isinstance(output_offset, bool) or output_offset < 0:
        raise InvalidRequest(f"output_offset: must be an integer >= 0, got {output_offset!r}")
