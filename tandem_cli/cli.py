"""The `tandem` command line: generate (against a server or offline), status, serve, scale, bench (tandem_cli.bench).

Exit codes: 0 success, 1 runtime failure (server unreachable, deadline, engine error), 2 bad input (flags,
JSONL lines, rejected requests). Expected errors print one line on stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tandem_cli.bench.cli import add_bench_parser
from tandem_cli.inputs import (
    GenerationInput,
    InputError,
    positive_int,
    prompt_from_text,
    read_jsonl,
    sampling_from_flags,
)
from tandem_cli.offline import DEFAULT_MODEL, EngineUnavailable, run_offline
from tandem_cli.output import OutputRecord, status_json, status_table, write_atomic
from tandem_cli.scale import add_api_key_flag, add_scale_parser
from tandem_cli.tls_flags import add_tls_flags, tls_from_args
from tandem_client.channel import ADDRESS_ENV, DEFAULT_ADDRESS, resolve_address
from tandem_client.client import Client
from tandem_client.errors import InvalidArgument, TandemError
from tandem_client.tls import TLSError

EXIT_RUNTIME = 1
EXIT_INPUT = 2
DEFAULT_CONCURRENCY = 8
DEFAULT_STATUS_TIMEOUT = 10.0


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not value > 0:  # also rejects NaN
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def _add_generate(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("generate", help="generate text for a prompt or a JSONL file of requests")
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--server", metavar="HOST:PORT", help=f"router address (default: ${ADDRESS_ENV} or {DEFAULT_ADDRESS})"
    )
    where.add_argument("--offline", action="store_true", help="run the engine in this process, no server")
    add_api_key_flag(p)
    add_tls_flags(p)
    p.add_argument(
        "--model",
        metavar="SPEC",
        help="model to use (offline default: smollm2-135m-instruct; server: the served model)",
    )
    p.add_argument(
        "--max-tokens",
        type=positive_int,
        default=64,
        metavar="N",
        help="most tokens per request (default 64)",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        metavar="T",
        help="0 (default) is greedy, so results reproduce",
    )
    p.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling mass in (0, 1]")
    p.add_argument("--top-k", type=int, metavar="K", help="sample from the K most likely tokens (0: all)")
    p.add_argument("--seed", type=int, metavar="S", help="seed for random sampling (temperature > 0)")
    p.add_argument(
        "--stop", action="append", default=[], metavar="STR", help="stop string (repeat for several)"
    )
    p.add_argument(
        "--logit-bias",
        action="append",
        default=[],
        metavar="ID=BIAS",
        help="add BIAS (-100 to 100) to token ID's logit before sampling (repeat for several; an --input "
        "line's own logit_bias replaces them for that line)",
    )
    p.add_argument(
        "--presence-penalty",
        type=float,
        metavar="P",
        help="subtract P (-2 to 2) from the logit of every token already generated",
    )
    p.add_argument(
        "--frequency-penalty",
        type=float,
        metavar="F",
        help="subtract F (-2 to 2) times the number of times a token was generated from its logit",
    )
    p.add_argument(
        "--repetition-penalty",
        type=float,
        metavar="R",
        help="divide (multiply, if negative) by R (0 to 10; 1 is off) the logit of every token in the prompt "
        "or already generated",
    )
    p.add_argument(
        "--logprobs", type=int, metavar="N", help="return chosen-token logprobs and the top N alternatives"
    )
    p.add_argument(
        "--prompt-logprobs",
        type=int,
        metavar="N",
        help="score the prompt: each prompt token's logprob after the first, and the top N alternatives",
    )
    p.add_argument("--chat", action="store_true", help="send plain prompts as a user message of a chat")
    p.add_argument("--json", action="store_true", help="print one JSON line per request, in input order")
    p.add_argument(
        "--input",
        metavar="FILE.jsonl",
        help='one request per line: {"prompt"|"messages"|"prompt_token_ids": ...} plus optional '
        "max_tokens, temperature, top_p, top_k, seed, stop, logit_bias, presence_penalty, frequency_penalty, "
        "repetition_penalty",
    )
    p.add_argument("--output", metavar="FILE.jsonl", help="write the JSON lines to FILE (atomically)")
    p.add_argument(
        "--concurrency",
        type=positive_int,
        metavar="N",
        help=f"requests in flight (server mode, default {DEFAULT_CONCURRENCY})",
    )
    p.add_argument(
        "--timeout", type=_positive_float, metavar="S", help="deadline per request in seconds (server mode)"
    )
    p.add_argument("prompt", nargs="?", metavar="PROMPT", help="the prompt (or use --input)")
    p.set_defaults(handler=cmd_generate)


def _add_status(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("status", help="show the router's workers: role, state, KV blocks, load")
    p.add_argument(
        "--server", metavar="HOST:PORT", help=f"router address (default: ${ADDRESS_ENV} or {DEFAULT_ADDRESS})"
    )
    add_api_key_flag(p)
    add_tls_flags(p)
    p.add_argument("--json", action="store_true", help="print the status as one JSON object")
    p.add_argument("--timeout", type=_positive_float, default=DEFAULT_STATUS_TIMEOUT, metavar="S")
    p.set_defaults(handler=cmd_status)


def _add_serve(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("serve", help="start a local cluster: Ray workers plus the router")
    p.add_argument("--config", metavar="FILE", help="deployment config (YAML)")
    p.set_defaults(handler=cmd_serve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem", description="Tandem: disaggregated prefill/decode LLM serving"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(commands)
    _add_status(commands)
    _add_serve(commands)
    add_scale_parser(commands)
    add_bench_parser(commands)
    return parser


def _check_generate_flags(args: argparse.Namespace) -> None:
    if (args.prompt is None) == (args.input is None):
        raise InputError("give a PROMPT or --input FILE.jsonl (exactly one)")
    if args.offline and args.concurrency is not None:
        raise InputError("--concurrency applies to server mode only (the offline engine batches by itself)")
    if args.offline and args.timeout is not None:
        raise InputError("--timeout applies to server mode only")


def _collect_inputs(args: argparse.Namespace) -> list[GenerationInput]:
    base = sampling_from_flags(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        logprobs=args.logprobs,
        logit_bias=args.logit_bias,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        prompt_logprobs=args.prompt_logprobs,
    )
    if args.input is not None:
        return read_jsonl(args.input, base, chat=args.chat)
    return [GenerationInput(0, prompt_from_text(args.prompt, args.chat), base)]


def _run(args: argparse.Namespace, inputs: list[GenerationInput]) -> list[OutputRecord]:
    progress = args.input is not None
    if args.offline:
        return run_offline(args.model or DEFAULT_MODEL, inputs, progress)
    from tandem_cli.remote import run_remote

    return run_remote(
        resolve_address(args.server),
        args.model,
        inputs,
        concurrency=args.concurrency or DEFAULT_CONCURRENCY,
        timeout=args.timeout,
        progress=progress,
        api_key=args.api_key,
        tls=tls_from_args(args),
    )


def cmd_generate(args: argparse.Namespace) -> int:
    _check_generate_flags(args)
    inputs = _collect_inputs(args)  # every line is checked before anything is generated
    if not args.offline and args.prompt is not None and not (args.json or args.output):
        from tandem_cli.remote import stream_text

        address = resolve_address(args.server)
        stream_text(
            address, args.model, inputs[0], args.timeout, sys.stdout, args.api_key, tls_from_args(args)
        )
        return 0
    records = _run(args, inputs)
    lines = [record.to_json() for record in records]
    if args.output:
        write_atomic(args.output, lines)
        print(f"tandem: wrote {len(lines)} results to {args.output}", file=sys.stderr)
    if args.json:
        print("\n".join(lines))
    elif not args.output:
        print("\n".join(record.text for record in records))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    address = resolve_address(args.server)
    with Client(address, timeout=args.timeout, api_key=args.api_key, tls=tls_from_args(args)) as client:
        status = client.status()
    print(status_json(status) if args.json else status_table(status))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from deploy.serve import main as serve_main
    except ModuleNotFoundError as exc:
        if exc.name not in ("deploy", "deploy.serve"):
            raise
        print(
            "tandem: error: `tandem serve` is not available: deploy/serve.py is not installed",
            file=sys.stderr,
        )
        return EXIT_RUNTIME
    argv = ["--config", args.config] if args.config else []
    return int(serve_main(argv) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except (InputError, InvalidArgument, TLSError) as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return EXIT_INPUT
    except (TandemError, EngineUnavailable, OSError) as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    except KeyboardInterrupt:
        print("tandem: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
