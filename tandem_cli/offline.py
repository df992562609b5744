"""`tandem generate --offline`: run the engine in this process, no server.

model_runtime (and with it torch) is imported inside the functions only, so the SDK and the rest of the CLI
never pay for it and the SDK's dependencies stay grpc + protobuf.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from tandem_cli.inputs import GenerationInput, InputError
from tandem_cli.output import OutputRecord
from tandem_client.types import Prompt, Sampling, TokenLogprob, TopLogprob

if TYPE_CHECKING:
    from model_runtime.request import Completion, PromptInput, SamplingParams
    from model_runtime.sampler import TokenLogprobs

DEFAULT_MODEL = "smollm2-135m-instruct"


class EngineUnavailable(RuntimeError):
    """The engine (model_runtime) cannot be imported in this installation."""


def engine_prompt(prompt: Prompt) -> PromptInput:
    from model_runtime.request import ChatMessage, PromptInput

    if prompt.messages is not None:
        return PromptInput(messages=tuple(ChatMessage(m.role, m.content) for m in prompt.messages))
    return PromptInput(text=prompt.text, token_ids=prompt.token_ids)


def engine_sampling(sampling: Sampling) -> SamplingParams:
    """The engine's SamplingParams (which checks every range); unset fields keep the engine's defaults."""
    from model_runtime.request import SamplingParams

    default = SamplingParams()
    return SamplingParams(
        temperature=default.temperature if sampling.temperature is None else sampling.temperature,
        top_p=default.top_p if sampling.top_p is None else sampling.top_p,
        top_k=default.top_k if sampling.top_k is None else sampling.top_k,
        seed=sampling.seed,
        max_tokens=default.max_tokens if sampling.max_tokens is None else sampling.max_tokens,
        stop=sampling.stop,
        stop_token_ids=sampling.stop_token_ids,
        ignore_eos=sampling.ignore_eos,
        logprobs=sampling.logprobs,
        logit_bias=tuple(dict(sampling.logit_bias).items()),  # Sampling keeps (id, bias) pairs
        presence_penalty=sampling.presence_penalty or 0.0,
        frequency_penalty=sampling.frequency_penalty or 0.0,
        repetition_penalty=1.0 if sampling.repetition_penalty is None else sampling.repetition_penalty,
        prompt_logprobs=sampling.prompt_logprobs,
    )


def prepare(inputs: Sequence[GenerationInput]) -> tuple[list[PromptInput], list[SamplingParams]]:
    """Convert every input before anything runs; a bad value raises InputError naming its line."""
    prompts, params = [], []
    for item in inputs:
        where = f"line {item.line}: " if item.line else ""
        try:
            prompts.append(engine_prompt(item.prompt))
            params.append(engine_sampling(item.sampling))
        except ValueError as exc:  # SamplingError names the parameter
            raise InputError(f"{where}{exc}") from None
    return prompts, params


def record_from_completion(
    completion: Completion, with_logprobs: bool, with_prompt_logprobs: bool = False
) -> OutputRecord:
    def entries(ids: Sequence[int], scores: Sequence[TokenLogprobs | None]) -> tuple[TokenLogprob, ...]:
        return tuple(
            TokenLogprob(token_id, lp[0], tuple(TopLogprob(t, v) for t, v in lp[1]))
            for token_id, lp in zip(ids, scores)
            if lp is not None
        )

    logprobs = entries(completion.token_ids, completion.logprobs or ()) if with_logprobs else None
    prompt_logprobs = None
    if with_prompt_logprobs:  # the prompt's first token has no score
        prompt_logprobs = entries(completion.prompt_token_ids[1:], (completion.prompt_logprobs or [None])[1:])
    return OutputRecord(
        prompt_token_ids=tuple(completion.prompt_token_ids),
        token_ids=tuple(completion.token_ids),
        text=completion.text,
        finish_reason=completion.finish_reason,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def run_offline(model: str, inputs: Sequence[GenerationInput], progress: bool) -> list[OutputRecord]:
    """Load the model, run every input (the engine batches them) and return results in input order."""
    prompts, params = prepare(inputs)
    try:
        from model_runtime.llm import LLM
    except ModuleNotFoundError as exc:
        raise EngineUnavailable(
            f"offline mode needs the engine (model_runtime.llm), which failed to import: {exc}"
        ) from exc

    try:
        llm = LLM(model=model)
    except ValueError as exc:  # ModelLoadError and friends carry a message meant for the user
        raise InputError(f"--model {model}: {exc}") from None
    try:
        completions = llm.generate(prompts, params, progress=progress)
    except ValueError as exc:  # e.g. a prompt longer than the model's context
        raise InputError(str(exc)) from None
    with_logprobs = any(p.logprobs is not None for p in params)
    with_prompt_logprobs = any(p.prompt_logprobs is not None for p in params)
    return [record_from_completion(c, with_logprobs, with_prompt_logprobs) for c in completions]
