"""`tandem generate --server`: run inputs through the SDK with bounded concurrency, results in input order."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from typing import TextIO

from tqdm import tqdm

from tandem_cli.inputs import GenerationInput, InputError
from tandem_cli.output import OutputRecord
from tandem_client import wire
from tandem_client.aio import AsyncClient
from tandem_client.client import Client
from tandem_client.errors import InvalidArgument, TandemError
from tandem_client.tls import TLSFiles
from tandem_client.types import GenerationDelta, GenerationResult


def _where(item: GenerationInput) -> str:
    return f"line {item.line}: " if item.line else ""


def check_requests(inputs: Sequence[GenerationInput], model: str | None) -> None:
    """Build every request message before sending any, so wire-level problems stop the run up front."""
    for item in inputs:
        try:
            wire.build_request(item.prompt, item.sampling, model)
        except InvalidArgument as exc:
            raise InputError(f"{_where(item)}{exc.details}") from None


def _tagged(item: GenerationInput, exc: TandemError) -> Exception:
    """The server's error with the input line in front; a rejected request is the user's input error."""
    if isinstance(exc, InvalidArgument):
        return InputError(f"{_where(item)}{exc.details} (rejected by the server)")
    return type(exc)(exc.code, f"{_where(item)}{exc.details}")


def run_remote(
    address: str,
    model: str | None,
    inputs: Sequence[GenerationInput],
    *,
    concurrency: int,
    timeout: float | None,
    progress: bool,
    api_key: str | None = None,
    tls: TLSFiles | None = None,
) -> list[OutputRecord]:
    check_requests(inputs, model)
    return asyncio.run(_run_all(address, model, inputs, concurrency, timeout, progress, api_key, tls))


async def _run_all(
    address: str,
    model: str | None,
    inputs: Sequence[GenerationInput],
    concurrency: int,
    timeout: float | None,
    progress: bool,
    api_key: str | None,
    tls: TLSFiles | None,
) -> list[OutputRecord]:
    results: list[GenerationResult | None] = [None] * len(inputs)
    slots = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(inputs), file=sys.stderr, disable=not progress, unit="req")

    async def run_one(index: int, client: AsyncClient) -> None:
        item = inputs[index]
        async with slots:
            try:
                results[index] = await client.generate(item.prompt, sampling=item.sampling, model=model)
            except TandemError as exc:
                raise _tagged(item, exc) from None
        bar.update(1)

    try:
        async with (
            AsyncClient(address, timeout=timeout, api_key=api_key, tls=tls) as client,
            asyncio.TaskGroup() as group,
        ):
            for index in range(len(inputs)):
                group.create_task(run_one(index, client))
    except ExceptionGroup as failures:
        # TaskGroup cancelled the other requests already; report the first failure on its own.
        raise failures.exceptions[0] from None
    finally:
        bar.close()
    with_logprobs = any(item.sampling.logprobs is not None for item in inputs)
    with_prompt = any(item.sampling.prompt_logprobs is not None for item in inputs)
    return [OutputRecord.from_result(r, with_logprobs, with_prompt) for r in results if r is not None]


def stream_text(
    address: str,
    model: str | None,
    item: GenerationInput,
    timeout: float | None,
    out: TextIO,
    api_key: str | None = None,
    tls: TLSFiles | None = None,
) -> GenerationResult:
    """Print one request's text to `out` as it is generated (for a single PROMPT without --json)."""
    check_requests([item], model)
    with (
        Client(address, timeout=timeout, api_key=api_key, tls=tls) as client,
        client.stream(item.prompt, sampling=item.sampling, model=model) as events,
    ):
        for event in events:
            if isinstance(event, GenerationDelta):
                out.write(event.text)
                out.flush()
        result = events.collect()
    out.write("\n")
    return result
