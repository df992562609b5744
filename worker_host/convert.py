"""Protobuf <-> engine types for the worker services (both roles)."""

from __future__ import annotations

from model_runtime.request import Priority, SamplingParams
from model_runtime.sampler import TokenLogprobs
from tandem_api.tandem.v1 import generate_pb2, worker_pb2

FINISH_REASONS = {
    "stop": generate_pb2.FINISH_REASON_STOP,
    "length": generate_pb2.FINISH_REASON_LENGTH,
    "abort": generate_pb2.FINISH_REASON_ABORT,
}


def sampling_from_proto(msg: worker_pb2.EngineSampling) -> SamplingParams:
    """Raises SamplingError naming the parameter when a value is out of range."""
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
        max_tokens=msg.max_tokens,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        logit_bias=tuple(sorted(msg.logit_bias.items())),
        presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
    )


def priority_from_proto(value: int) -> Priority:
    """A worker request's PriorityClass -> the engine's class. NORMAL (unset: an older router) and any value
    this worker does not know schedule as interactive, as every request did before classes existed."""
    return Priority.BATCH if value == worker_pb2.PRIORITY_CLASS_BATCH else Priority.INTERACTIVE


def logprob_proto(token_id: int, lp: TokenLogprobs) -> generate_pb2.TokenLogprob:
    chosen, top = lp
    return generate_pb2.TokenLogprob(
        token_id=token_id,
        logprob=chosen,
        top=[generate_pb2.TopLogprob(token_id=t, logprob=v) for t, v in top],
    )


def prompt_logprobs_proto(
    prompt: list[int], scores: list[TokenLogprobs | None] | None
) -> list[generate_pb2.TokenLogprob]:
    """A request's prompt scores (StepOutput.prompt_logprobs) as the wire has them: prompt tokens 1..n-1."""
    if scores is None:
        return []
    return [logprob_proto(token, lp) for token, lp in zip(prompt[1:], scores[1:]) if lp is not None]
