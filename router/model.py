"""`ServedModel`: what the router knows about the model it serves, loaded without torch."""

from __future__ import annotations

from dataclasses import dataclass

from model_runtime.tokenizer import Tokenizer
from model_runtime.weights.config_loading import load_model_config
from model_runtime.weights.source import resolve_model


@dataclass(frozen=True, eq=False)
class ServedModel:
    """The tokenizer plus the limits validation needs. `id` is the name clients put in GenerateRequest.model."""

    id: str
    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def load(cls, spec: str, max_model_len: int | None = None) -> ServedModel:
        """Resolve `spec` and read its config and tokenizer (raises ModelLoadError naming the problem).

        max_model_len is clamped to the model's context exactly as the engine clamps it, so the router's
        length rule and the workers' agree.
        """
        source = resolve_model(spec)
        config = load_model_config(source)
        tokenizer = Tokenizer.from_source(source)
        context = config.max_position_embeddings
        return cls(
            id=source.name,
            tokenizer=tokenizer,
            vocab_size=config.vocab_size,
            max_model_len=min(max_model_len or context, context),
            # The same end-of-sequence set the engine stops on: the config's and the tokenizer's.
            eos_token_ids=tuple(sorted(set(config.eos_token_ids) | set(tokenizer.eos_token_ids))),
        )
