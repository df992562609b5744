"""The offline API: run a list of prompts through the batching engine and return whole completions.

This is the colocated reference the disaggregated service must match token for token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from tqdm import tqdm

from model_runtime.config import EngineConfig
from model_runtime.engine import Engine, InvalidRequest
from model_runtime.heap import frozen_while_running
from model_runtime.request import Completion, PromptInput, SamplingParams


class LLM:
    def __init__(self, model: str | None = None, config: EngineConfig | None = None) -> None:
        """`model` (a name, path or dummy:...) wins over `config.model`; with neither, EngineConfig's default
        model (the embedded SmolLM2). Before, a config's own model was replaced by that default."""
        if config is None:
            config = EngineConfig() if model is None else EngineConfig(model=model)
        elif model is not None and config.model != model:
            config = replace(config, model=model)
        self.engine = Engine(config)
        self.tokenizer = self.engine.tokenizer

    def encode(self, prompt: PromptInput) -> list[int]:
        if prompt.token_ids is not None:
            return list(prompt.token_ids)
        if prompt.messages is not None:
            return self.tokenizer.encode_chat(list(prompt.messages))
        assert prompt.text is not None  # PromptInput guarantees exactly one field
        return self.tokenizer.encode(prompt.text)

    def generate(
        self,
        prompts: Sequence[PromptInput],
        sampling: Sequence[SamplingParams] | SamplingParams,
        progress: bool = False,
    ) -> list[Completion]:
        """All prompts run together; results come back in input order. Every prompt is validated before any
        runs, so a bad one fails the call with an error naming its index and nothing is generated."""
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        if len(params) != len(prompts):
            raise ValueError(f"sampling: {len(params)} parameter sets for {len(prompts)} prompts")
        encoded = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            ids = self.encode(prompt)
            try:
                self.engine.validate(ids, sp)
            except InvalidRequest as exc:
                raise InvalidRequest(f"request {i}: {exc}") from None
            encoded.append(ids)
        return self._run(encoded, params, progress)

    def _run(
        self, encoded: list[list[int]], params: list[SamplingParams], progress: bool
    ) -> list[Completion]:
        ids = [f"offline-{i}" for i in range(len(encoded))]
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        texts: dict[str, list[str]] = {rid: [] for rid in ids}
        logprobs: dict[str, list] = {rid: [] for rid in ids}
        reasons: dict[str, str] = {}
        scores: dict[str, list] = {}
        for rid, prompt_ids, sp in zip(ids, encoded, params):
            self.engine.add_request(rid, prompt_ids, sp)
        bar = tqdm(total=len(ids), desc="generate", unit="req", disable=not progress, file=None)
        try:
            # The engine's own long-lived objects stay out of full collections while it runs (model_runtime.heap).
            with frozen_while_running():
                while self.engine.has_unfinished():
                    for out in self.engine.step():
                        tokens[out.request_id].extend(out.token_ids)
                        texts[out.request_id].append(out.text)
                        if out.logprobs:
                            logprobs[out.request_id].extend(out.logprobs)
                        if out.prompt_logprobs is not None:
                            scores[out.request_id] = out.prompt_logprobs
                        if out.finish_reason is not None:
                            reasons[out.request_id] = out.finish_reason
                            bar.update(1)
        finally:
            bar.close()
            for rid in ids:
                if rid not in reasons:
                    self.engine.abort(rid)
        return [
            Completion(
                rid,
                encoded[i],
                tokens[rid],
                "".join(texts[rid]),
                reasons[rid],
                logprobs[rid] if params[i].logprobs is not None else None,
                scores.get(rid),
            )
            for i, rid in enumerate(ids)
        ]
