"""Text <-> token ids and chat templates, for any `ModelSource`. Imports no torch (the router uses it).

    tok = Tokenizer.from_source(resolve_model("smollm2-135m-instruct"))
    ids = tok.encode_chat([ChatMessage("user", "Hi!")])     # template rendered, then encoded
    text = tok.decode(output_ids)                           # special tokens dropped

Hugging Face directories use tokenizer.json (+ tokenizer_config.json / chat_template.jinja for the template and
the special tokens); GGUF files use the tokenizer in their metadata (model_runtime.weights.gguf_vocab); dummy
shapes use a byte-level tokenizer built in code (model_runtime.weights.dummy_vocab: no files, ids past its 258
decode to nothing), so serving `dummy:llama-3-8b` needs no embedded model.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as BackendTokenizer

from model_runtime.weights import dummy_vocab
from model_runtime.weights.errors import ModelLoadError
from model_runtime.weights.gguf_vocab import tokenizer_from_gguf
from model_runtime.weights.source import ModelSource, SourceFormat, read_json, resolve_model


class ChatTemplateError(ValueError):
    """The model has no chat template, the messages are malformed, or the template refused them."""


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


class MessageLike(Protocol):
    @property
    def role(self) -> str: ...

    @property
    def content(self) -> str: ...


Message = MessageLike | tuple[str, str] | Mapping[str, str]


class Tokenizer:
    """A `tokenizers` backend plus the special tokens and chat template that travel with the model."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        name: str = "",
    ) -> None:
        self._backend = backend
        self.name = name
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._chat_template = chat_template
        self.bos_token_id = _token_id(backend, bos_token)
        eos_id = _token_id(backend, eos_token)
        ids = ([] if eos_id is None else [eos_id]) + list(extra_eos_token_ids)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))
        self._template: jinja2.Template | None = None

    @classmethod
    def from_source(cls, source: ModelSource) -> Tokenizer:
        """The tokenizer of a resolved model; raises `ModelLoadError` naming the missing or bad file."""
        if source.format is SourceFormat.GGUF:
            parts = tokenizer_from_gguf(source.require_gguf())
            return cls(
                parts.backend,
                bos_token=parts.bos_token,
                eos_token=parts.eos_token,
                extra_eos_token_ids=parts.eos_token_ids,
                chat_template=parts.chat_template,
                name=source.name,
            )
        if source.format is SourceFormat.DUMMY:
            return cls(
                dummy_vocab.byte_level_backend(),
                bos_token=dummy_vocab.BOS_TOKEN,
                eos_token=dummy_vocab.EOS_TOKEN,
                chat_template=dummy_vocab.CHAT_TEMPLATE,
                name=source.name,
            )
        return _from_hf_dir(source.require_path(), source.name)

    @classmethod
    def from_spec(cls, spec: str) -> Tokenizer:
        return cls.from_source(resolve_model(spec))

    @property
    def backend(self) -> BackendTokenizer:
        """The underlying `tokenizers.Tokenizer` (shared, do not modify)."""
        return self._backend

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (base vocabulary plus added tokens)."""
        return int(self._backend.get_vocab_size(with_added_tokens=True))

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds the BOS (or other markers) the model expects."""
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """Render the model's chat template (Hugging Face conventions) over `messages`."""
        template = self._compiled_template()
        context = {
            "messages": [_message_dict(m, i) for i, m in enumerate(messages)],
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
        }
        try:
            return template.render(**context)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"{self.name}: chat template failed: {exc}") from exc

    def encode_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> list[int]:
        """Ids of the rendered chat. The template writes its own special tokens, so none are added here."""
        return self.encode(
            self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False
        )

    def _compiled_template(self) -> jinja2.Template:
        if self._template is None:
            if not self._chat_template:
                raise ChatTemplateError(f"{self.name}: the model has no chat template; send a plain prompt")
            try:
                self._template = _chat_environment().from_string(self._chat_template)
            except jinja2.TemplateSyntaxError as exc:
                raise ChatTemplateError(f"{self.name}: the chat template does not parse: {exc}") from exc
        return self._template


def _chat_environment() -> ImmutableSandboxedEnvironment:
    # The same environment options transformers renders templates with, so templates behave identically.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"chat template: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)


def _message_dict(message: Message, index: int) -> dict[str, str]:
    role: object
    content: object
    if isinstance(message, tuple):
        if len(message) != 2:
            raise ChatTemplateError(f"messages[{index}]: a tuple message must be (role, content)")
        role, content = message
    elif isinstance(message, Mapping):
        role, content = message.get("role"), message.get("content")
    else:
        role, content = getattr(message, "role", None), getattr(message, "content", None)
    if not isinstance(role, str) or not role:
        raise ChatTemplateError(f"messages[{index}].role: must be a non-empty string, got {role!r}")
    if not isinstance(content, str):
        raise ChatTemplateError(f"messages[{index}].content: must be a string, got {type(content).__name__}")
    return {"role": role, "content": content}


def _token_id(backend: BackendTokenizer, token: str | None) -> int | None:
    return None if token is None else backend.token_to_id(token)


def _from_hf_dir(directory: Path, name: str) -> Tokenizer:
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise ModelLoadError(f"{directory}: no tokenizer.json (only fast tokenizers are supported)")
    try:
        backend = BackendTokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed files
        raise ModelLoadError(f"{path}: cannot load tokenizer ({exc})") from exc
    config_path = directory / "tokenizer_config.json"
    config = read_json(config_path) if config_path.is_file() else {}
    generation = directory / "generation_config.json"
    extra_eos = _eos_ids(read_json(generation), generation) if generation.is_file() else []
    return Tokenizer(
        backend,
        bos_token=_special(config.get("bos_token")),
        eos_token=_special(config.get("eos_token")),
        extra_eos_token_ids=extra_eos,
        chat_template=_hf_chat_template(directory, config),
        name=name,
    )


def _special(value: object) -> str | None:
    # tokenizer_config.json writes special tokens as plain strings or as AddedToken objects.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _hf_chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def _eos_ids(generation: dict[str, Any], where: Path) -> list[int]:
    value = generation.get("eos_token_id")
    values = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ModelLoadError(f"{where}: eos_token_id must be an integer or a list of integers, got {value!r}")
    return values
