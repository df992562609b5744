"""The router's `GenerateResponse` messages (Delta..., Final) -> OpenAI's JSON objects.

    streaming  one chunk per Delta ("text_completion" / "chat.completion.chunk"), a last chunk with the
               finish_reason, then (stream_options.include_usage) a chunk with no choices and the usage
    otherwise  one "text_completion" / "chat.completion" object once the Final arrived

With several choices (n > 1, or a list of prompts) there is one Answer per choice (its `index`); their chunks
interleave in one stream as their tokens come, and `whole_response` / `usage_chunk` join them: each prompt
counted once, the completions summed. With several prompts and return_token_ids each choice carries its
prompt's `prompt_token_ids`.

With echo (completions) the choice's text starts with the prompt (its text as sent, or its token ids decoded),
and with logprobs its first entries are the prompt's tokens, the first with a null logprob (nothing predicts it);
a stream sends them in its first chunk.

With prompt_logprobs (vLLM's extension; whole responses only) the choice has `prompt_logprobs` as vLLM lays it
out: one entry per prompt token, null for the first, else {"<token id>": {"logprob", "rank", "decoded_token"}}
for the prompt's token and its top alternatives. An alternative's rank is its place among them (1 = the most
likely); the prompt token's rank is its place there when it is one of them, else null (the engine does not
count the tokens above it).

Logprobs carry token strings as OpenAI's do; a token that is part of a multi-byte character reads as the
replacement character, and chat's `bytes` field gives its UTF-8 bytes as the tokenizer decodes it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from model_runtime.tokenizer import Tokenizer
from router.openai_api.requests import OpenAIRequest
from tandem_api.tandem.v1 import generate_pb2

FINISH_REASONS = {
    generate_pb2.FINISH_REASON_STOP: "stop",
    generate_pb2.FINISH_REASON_LENGTH: "length",
    generate_pb2.FINISH_REASON_ABORT: "abort",
}


class Answer:
    """Builds one request's OpenAI objects from its GenerateResponse messages, in order."""

    def __init__(
        self,
        request: OpenAIRequest,
        model: str,
        tokenizer: Tokenizer,
        index: int = 0,
        usage_chunk: bool = True,
    ) -> None:
        """`index`: the choice's; `usage_chunk`: whether last_chunks ends with the usage chunk (when asked for);
        with several choices the stream's one usage chunk comes from `usage_chunk` after all of them."""
        self.request = request
        self.index = index
        self._usage_chunk = usage_chunk
        self._model = model
        self._tokenizer = tokenizer
        self._created = int(time.time())
        self._object = "chat.completion" if request.chat else "text_completion"
        self._chunks_sent = 0
        self._text: list[str] = []
        self._token_ids: list[int] = []
        self._logprobs: list[generate_pb2.TokenLogprob] = []
        self.final: generate_pb2.Final | None = None  # non-streaming: kept by add_final
        self._offset = 0  # characters of completion text before the current delta (completions' text_offset)
        self._prompt_logprobs: list[generate_pb2.TokenLogprob] = []  # echo: the first Delta's

    # --- streaming ------------------------------------------------------------------------------------
    def chunk(self, delta: generate_pb2.Delta) -> dict[str, Any]:
        """The chunk for one Delta (sent even when its text is held back: the client sees every step)."""
        choice: dict[str, Any] = {"index": self.index}
        if self.request.chat:
            body = {"content": delta.text}
            if self._chunks_sent == 0:
                body = {"role": "assistant", **body}
            choice["delta"] = body
        else:
            choice["text"] = delta.text
        echoed = self.request.echo and self._chunks_sent == 0
        if echoed:
            choice["text"] = self._prompt_text() + delta.text
        choice["logprobs"] = self._logprobs_of(delta.logprobs, delta.prompt_logprobs if echoed else None)
        choice["finish_reason"] = None
        if self.request.return_token_ids:
            choice["token_ids"] = list(delta.token_ids)
        return self._chunk([choice])

    def last_chunks(self, final: generate_pb2.Final) -> list[dict[str, Any]]:
        """The chunk with the finish_reason, and the usage chunk when asked for."""
        choice: dict[str, Any] = {"index": self.index}
        if self.request.chat:
            choice["delta"] = {"role": "assistant", "content": ""} if self._chunks_sent == 0 else {}
        else:
            choice["text"] = ""
        choice["logprobs"] = None
        choice["finish_reason"] = FINISH_REASONS.get(final.finish_reason, "stop")
        self.final = final
        chunks = [self._chunk([choice])]
        if self.request.include_usage and self._usage_chunk:
            chunks.append(usage_chunk([self]))
        return chunks

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        self._chunks_sent += 1
        chunk: dict[str, Any] = {
            "id": self.request.request_id,
            "object": "chat.completion.chunk" if self.request.chat else "text_completion",
            "created": self._created,
            "model": self._model,
            "choices": choices,
        }
        if self.request.include_usage:
            chunk["usage"] = None  # as OpenAI: present on every chunk, set on the last
        return chunk

    # --- one response ---------------------------------------------------------------------------------
    def add(self, delta: generate_pb2.Delta) -> None:
        self._text.append(delta.text)
        self._token_ids.extend(delta.token_ids)
        self._logprobs.extend(delta.logprobs)
        self._prompt_logprobs.extend(delta.prompt_logprobs)

    def add_final(self, final: generate_pb2.Final) -> None:
        self.final = final

    def whole(self) -> dict[str, Any]:
        """The whole response, once add_final had the Final."""
        return whole_response([self])

    def choice(self) -> dict[str, Any]:
        """This choice of the whole response, once add_final had the Final."""
        final = self._final()
        text = "".join(self._text)
        choice: dict[str, Any] = {"index": self.index}
        if self.request.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = self._prompt_text() + text if self.request.echo else text
        self._offset = 0
        choice["logprobs"] = self._logprobs_of(
            self._logprobs, self._prompt_logprobs if self.request.echo else None
        )
        choice["finish_reason"] = FINISH_REASONS.get(final.finish_reason, "stop")
        if self.request.prompt_logprobs is not None:
            choice["prompt_logprobs"] = [None, *(self._prompt_entry(e) for e in self._prompt_logprobs)]
        if self.request.return_token_ids:
            choice["token_ids"] = self._token_ids
            if self.request.more_prompts:
                choice["prompt_token_ids"] = list(final.prompt_token_ids)
        return choice

    def _final(self) -> generate_pb2.Final:
        if self.final is None:  # the pipeline returns only after dispatch wrote the Final
            raise RuntimeError("the request ended without a Final message")
        return self.final

    # --- echo ----------------------------------------------------------------------------------------
    def _prompt(self) -> generate_pb2.GenerateRequest:
        return self.request.prompt_of(self.index)

    def _prompt_text(self) -> str:
        prompt = self._prompt()
        if prompt.WhichOneof("input") == "text":
            return prompt.text
        return self._tokenizer.decode(list(prompt.token_ids.ids))

    def _first_prompt_token(self) -> int:
        """The prompt's first token id (the scores start at the second): as the router tokenized it."""
        prompt = self._prompt()
        if prompt.WhichOneof("input") == "text":
            return self._tokenizer.encode(prompt.text)[0]
        return prompt.token_ids.ids[0]

    # --- logprobs -------------------------------------------------------------------------------------
    def _logprobs_of(
        self,
        entries: Sequence[generate_pb2.TokenLogprob],
        prompt: Sequence[generate_pb2.TokenLogprob] | None = None,
    ) -> dict[str, Any] | None:
        """`prompt`: echo's prompt scores, which come first (after the prompt's first token, unscored)."""
        if self.request.logprobs is None:
            return None
        if self.request.chat:
            return {"content": [self._chat_entry(e) for e in entries]}
        ids = [e.token_id for e in entries]
        logprobs: list[float | None] = [e.logprob for e in entries]
        tops: list[dict[str, float] | None] = [self._top(e) for e in entries]
        if prompt is not None:
            ids = [self._first_prompt_token(), *(e.token_id for e in prompt), *ids]
            logprobs = [None, *(e.logprob for e in prompt), *logprobs]
            tops = [None, *(self._top(e) for e in prompt), *tops]
        tokens = [self._token(t) for t in ids]
        offsets = []
        for token in tokens:
            offsets.append(self._offset)
            self._offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": logprobs,
            "top_logprobs": tops if self.request.logprobs else None,
            "text_offset": offsets,
        }

    def _top(self, entry: generate_pb2.TokenLogprob) -> dict[str, float]:
        """The alternatives echo's logprobs asked for (the engine may have scored more for prompt_logprobs)."""
        return {self._token(t.token_id): t.logprob for t in entry.top[: self.request.logprobs]}

    def _prompt_entry(self, entry: generate_pb2.TokenLogprob) -> dict[str, dict[str, Any]]:
        """One prompt position in vLLM's layout (see the module docstring)."""
        alternatives = entry.top[: self.request.prompt_logprobs]
        ranks = {t.token_id: i + 1 for i, t in enumerate(alternatives)}
        out = {
            str(entry.token_id): {
                "logprob": entry.logprob,
                "rank": ranks.get(entry.token_id),
                "decoded_token": self._token(entry.token_id),
            }
        }
        for t in alternatives:
            out.setdefault(
                str(t.token_id),
                {"logprob": t.logprob, "rank": ranks[t.token_id], "decoded_token": self._token(t.token_id)},
            )
        return out

    def _chat_entry(self, entry: generate_pb2.TokenLogprob) -> dict[str, Any]:
        token = self._token(entry.token_id)
        return {
            "token": token,
            "logprob": entry.logprob,
            "bytes": list(token.encode()),
            "top_logprobs": [
                {"token": (t := self._token(top.token_id)), "logprob": top.logprob, "bytes": list(t.encode())}
                for top in entry.top
            ],
        }

    def _token(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)


def whole_response(answers: Sequence[Answer]) -> dict[str, Any]:
    """The one response of a request's choices (answers in choice order, each with its Final)."""
    first = answers[0]
    response: dict[str, Any] = {
        "id": first.request.request_id,
        "object": first._object,
        "created": first._created,
        "model": first._model,
        "choices": [answer.choice() for answer in answers],
        "usage": joined_usage(answers),
    }
    if first.request.return_token_ids and not first.request.more_prompts:
        response["prompt_token_ids"] = list(first._final().prompt_token_ids)
    return response


def usage_chunk(answers: Sequence[Answer]) -> dict[str, Any]:
    """The stream's last chunk (stream_options.include_usage): no choices, the usage of them all."""
    chunk = answers[0]._chunk([])
    chunk["usage"] = joined_usage(answers)
    return chunk


def joined_usage(answers: Sequence[Answer]) -> dict[str, Any]:
    """The n choices of a prompt share it: each prompt counts once (its cached tokens as its first choice found
    them), every choice's completion adds up."""
    finals = [answer._final().usage for answer in answers]
    firsts = finals[:: answers[0].request.n]  # choice p * n is prompt p's first
    joined = generate_pb2.Usage(
        prompt_tokens=sum(u.prompt_tokens for u in firsts),
        completion_tokens=sum(u.completion_tokens for u in finals),
        cached_prompt_tokens=sum(u.cached_prompt_tokens for u in firsts),
    )
    return usage(joined)


def usage(message: generate_pb2.Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": message.prompt_tokens,
        "completion_tokens": message.completion_tokens,
        "total_tokens": message.prompt_tokens + message.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": message.cached_prompt_tokens},
    }
