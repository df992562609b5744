"""`tandem generate` input handling: JSONL parsing and its errors, flags -> SamplingParams, atomic output, exit
codes, and the offline plumbing (with a stand-in LLM: no model runs here)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import types
from typing import ClassVar

import pytest

from model_runtime.request import ChatMessage as EngineChatMessage
from model_runtime.request import Completion, PromptInput, SamplingParams
from tandem_cli.cli import main as cli_main
from tandem_cli.inputs import (
    GenerationInput,
    InputError,
    parse_jsonl,
    prompt_from_text,
    read_jsonl,
    sampling_from_flags,
)
from tandem_cli.offline import engine_prompt, engine_sampling, prepare, record_from_completion
from tandem_cli.output import OutputRecord, write_atomic
from tandem_client.types import ChatMessage, Prompt, Sampling

pytestmark = pytest.mark.unit

BASE = sampling_from_flags(max_tokens=64, temperature=0.0)
UNREACHABLE = "127.0.0.1:1"  # nothing listens on port 1: any attempt to generate fails with UNAVAILABLE


def _parse(*lines: str) -> list:
    return parse_jsonl(lines, BASE, source="in.jsonl")


# --- JSONL parsing ----------------------------------------------------------------------------------------------


def test_three_prompt_kinds_with_line_numbers_and_overrides() -> None:
    items = _parse(
        '{"prompt": "Hello", "max_tokens": 5, "stop": "\\n"}',
        "",
        '{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}',
        '{"prompt_token_ids": [1, 2, 3], "temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 7}',
    )
    assert [i.line for i in items] == [1, 3, 4]
    assert items[0].prompt == Prompt(text="Hello")
    assert items[0].sampling == Sampling(temperature=0.0, max_tokens=5, stop=("\n",))
    assert items[1].prompt.messages == (ChatMessage("system", "Be brief."), ChatMessage("user", "Hi"))
    assert items[1].sampling == BASE
    assert items[2].prompt == Prompt(token_ids=(1, 2, 3))
    assert items[2].sampling == Sampling(temperature=0.7, top_p=0.9, top_k=40, seed=7, max_tokens=64)


def test_chat_flag_wraps_plain_prompts() -> None:
    (item,) = parse_jsonl(['{"prompt": "Hi"}'], BASE, chat=True)
    assert item.prompt == Prompt(messages=(ChatMessage("user", "Hi"),))
    assert prompt_from_text("Hey", chat=False) == Prompt(text="Hey")


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"prompt": "a",}', r"in\.jsonl line 2: invalid JSON"),
        ('{"prompt": "a", "temprature": 1}', r"line 2: unknown key 'temprature'"),
        ('["a"]', r"line 2: expected a JSON object, got list"),
        ('{"max_tokens": 3}', r"line 2: give exactly one of prompt, messages, prompt_token_ids \(got none\)"),
        (
            '{"prompt": "a", "prompt_token_ids": [1]}',
            r"line 2: give exactly one of .*'prompt', 'prompt_token_ids'",
        ),
        ('{"prompt": ""}', r"line 2: prompt: must be a non-empty string"),
        ('{"prompt": 5}', r"line 2: prompt: must be a non-empty string"),
        (
            '{"prompt_token_ids": [1, -2]}',
            r"line 2: prompt_token_ids: must be a non-empty list of non-negative",
        ),
        ('{"prompt_token_ids": [true]}', r"line 2: prompt_token_ids"),
        ('{"prompt_token_ids": []}', r"line 2: prompt_token_ids"),
        ('{"messages": []}', r"line 2: messages: must be a non-empty list"),
        ('{"messages": [{"role": "user"}]}', r"line 2: messages\[0\]: must be an object with exactly"),
        ('{"messages": [{"role": "", "content": "x"}]}', r"line 2: messages\[0\]: role must be a non-empty"),
        ('{"prompt": "a", "max_tokens": "5"}', r"line 2: max_tokens: must be an integer, got '5'"),
        ('{"prompt": "a", "max_tokens": 5.0}', r"line 2: max_tokens: must be an integer"),
        ('{"prompt": "a", "seed": true}', r"line 2: seed: must be an integer"),
        ('{"prompt": "a", "temperature": "hot"}', r"line 2: temperature: must be a finite number"),
        ('{"prompt": "a", "top_p": NaN}', r"line 2: top_p: must be a finite number"),
        ('{"prompt": "a", "stop": [""]}', r"line 2: stop: must be a non-empty string or a list"),
        ('{"prompt": "a", "stop": 3}', r"line 2: stop"),
        ('{"prompt": "a", "logit_bias": [1]}', r"line 2: logit_bias: must be an object"),
        ('{"prompt": "a", "logit_bias": {"x": 1}}', r"line 2: logit_bias: keys must be token ids"),
        (
            '{"prompt": "a", "logit_bias": {"5": "up"}}',
            r"line 2: logit_bias: token 5: the bias must be a number",
        ),
    ],
)
def test_bad_lines_name_the_line_and_key(line: str, expected: str) -> None:
    with pytest.raises(InputError, match=expected):
        _parse('{"prompt": "fine"}', line, '{"prompt": "never reached"}')


def test_empty_and_unreadable_files(tmp_path: pathlib.Path) -> None:
    with pytest.raises(InputError, match="no requests"):
        _parse("", "  ")
    with pytest.raises(InputError, match=r"--input .*missing\.jsonl: cannot read it"):
        read_jsonl(str(tmp_path / "missing.jsonl"), BASE)


# --- flags and lines -> the engine's SamplingParams / PromptInput ---------------------------------------------


def test_flags_map_onto_sampling_params() -> None:
    flags = sampling_from_flags(
        max_tokens=12, temperature=0.5, top_p=0.8, top_k=5, seed=3, stop=["END", "\n\n"], logprobs=2
    )
    assert engine_sampling(flags) == SamplingParams(
        temperature=0.5, top_p=0.8, top_k=5, seed=3, max_tokens=12, stop=("END", "\n\n"), logprobs=2
    )


def test_unset_fields_keep_engine_defaults_and_cli_defaults_are_greedy() -> None:
    params = engine_sampling(BASE)
    default = SamplingParams()
    assert params.greedy and params.max_tokens == 64
    assert (params.top_p, params.top_k, params.seed, params.logprobs) == (
        default.top_p,
        default.top_k,
        default.seed,
        default.logprobs,
    )


def test_line_fields_override_flags_in_sampling_params() -> None:
    base = sampling_from_flags(max_tokens=64, temperature=0.0, top_k=9, stop=["x"])
    (item,) = parse_jsonl(['{"prompt": "a", "temperature": 1, "stop": ["y", "z"]}'], base)
    assert engine_sampling(item.sampling) == SamplingParams(
        temperature=1.0, top_k=9, max_tokens=64, stop=("y", "z")
    )


def test_a_lines_logit_bias_reaches_sampling_params_and_its_range_errors_name_the_line() -> None:
    (item,) = parse_jsonl(['{"prompt": "a", "logit_bias": {"7": -100, "3": 2.5}}'], BASE)
    assert engine_sampling(item.sampling).logit_bias == ((7, -100.0), (3, 2.5))
    items = _parse('{"prompt": "a"}', '{"prompt": "b", "logit_bias": {"7": 200}}')
    with pytest.raises(
        InputError, match=r"^line 2: logit_bias: token 7: the bias must be a number in \[-100, 100\]"
    ):
        prepare(items)


def test_logit_bias_flags_reach_sampling_params_and_a_lines_own_replaces_them() -> None:
    base = sampling_from_flags(max_tokens=8, temperature=0.0, logit_bias=["7=-100", " 3 = 2.5 "])
    assert engine_sampling(base).logit_bias == ((7, -100.0), (3, 2.5))
    kept, replaced = parse_jsonl(['{"prompt": "a"}', '{"prompt": "b", "logit_bias": {"9": 1}}'], base)
    assert engine_sampling(kept.sampling).logit_bias == ((7, -100.0), (3, 2.5))
    assert engine_sampling(replaced.sampling).logit_bias == ((9, 1.0),)
    out_of_range = sampling_from_flags(max_tokens=8, temperature=0.0, logit_bias=["7=200"])
    # the engine's range, named without a line: it came from the command line
    with pytest.raises(InputError, match=r"^logit_bias: token 7: the bias must be a number in \[-100, 100\]"):
        prepare([GenerationInput(0, Prompt(text="a"), out_of_range)])


def test_penalty_flags_and_line_fields_reach_sampling_params() -> None:
    base = sampling_from_flags(
        max_tokens=8, temperature=0.0, presence_penalty=0.5, frequency_penalty=1.0, repetition_penalty=1.2
    )
    kept, replaced = parse_jsonl(['{"prompt": "a"}', '{"prompt": "b", "frequency_penalty": -2}'], base)
    assert (
        engine_sampling(kept.sampling).presence_penalty,
        engine_sampling(kept.sampling).frequency_penalty,
    ) == (
        0.5,
        1.0,
    )
    assert engine_sampling(replaced.sampling).frequency_penalty == -2.0
    assert engine_sampling(kept.sampling).repetition_penalty == 1.2
    unset = engine_sampling(sampling_from_flags(max_tokens=8, temperature=0.0))
    assert (unset.presence_penalty, unset.frequency_penalty, unset.repetition_penalty) == (0.0, 0.0, 1.0)
    with pytest.raises(InputError, match=r"line 1: presence_penalty: must be a finite number, got 'some'"):
        _parse('{"prompt": "a", "presence_penalty": "some"}')


def test_engine_range_errors_name_the_line() -> None:
    items = _parse('{"prompt": "a"}', '{"prompt": "b"}', '{"prompt": "c", "top_p": 1.5}')
    with pytest.raises(InputError, match=r"^line 3: top_p: must be in \(0, 1\]"):
        prepare(items)


def test_prompts_map_onto_prompt_input() -> None:
    assert engine_prompt(Prompt(text="t")) == PromptInput(text="t")
    assert engine_prompt(Prompt(token_ids=(4, 5))) == PromptInput(token_ids=(4, 5))
    chat = engine_prompt(Prompt(messages=(ChatMessage("user", "hi"),)))
    assert chat == PromptInput(messages=(EngineChatMessage("user", "hi"),))


def test_completion_becomes_the_json_line() -> None:
    completion = Completion("r", [1, 2], [3, 4], "ab", "length", [(-0.1, [(3, -0.1), (9, -2.0)]), (-0.2, [])])
    plain = json.loads(record_from_completion(completion, with_logprobs=False).to_json())
    assert plain == {"prompt_token_ids": [1, 2], "token_ids": [3, 4], "text": "ab", "finish_reason": "length"}
    with_lp = json.loads(record_from_completion(completion, with_logprobs=True).to_json())
    assert with_lp["logprobs"][0] == {
        "token_id": 3,
        "logprob": -0.1,
        "top": [{"token_id": 3, "logprob": -0.1}, {"token_id": 9, "logprob": -2.0}],
    }
    assert with_lp["logprobs"][1] == {"token_id": 4, "logprob": -0.2, "top": []}
    scored = Completion("r", [1, 2, 5], [3], "a", "length", None, [None, (-1.5, [(7, -0.5)]), (-0.3, [])])
    line = json.loads(
        record_from_completion(scored, with_logprobs=False, with_prompt_logprobs=True).to_json()
    )
    assert "logprobs" not in line
    assert line["prompt_logprobs"] == [  # --prompt-logprobs: prompt tokens 1..n-1, the first has no score
        {"token_id": 2, "logprob": -1.5, "top": [{"token_id": 7, "logprob": -0.5}]},
        {"token_id": 5, "logprob": -0.3, "top": []},
    ]
    flags = sampling_from_flags(max_tokens=4, temperature=0.0, prompt_logprobs=2)
    assert engine_sampling(flags).prompt_logprobs == 2


# --- atomic output ----------------------------------------------------------------------------------------------


def test_write_atomic_replaces_whole_file(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "out.jsonl"
    target.write_text("old\n")
    write_atomic(str(target), ["a", "b"])
    assert target.read_text() == "a\nb\n"
    assert os.listdir(tmp_path) == ["out.jsonl"]


def test_write_atomic_failure_leaves_old_file_and_no_temp(tmp_path: pathlib.Path) -> None:
    target = tmp_path / "out.jsonl"
    target.write_text("old\n")

    def lines():
        yield "first"
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        write_atomic(str(target), lines())
    assert target.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["out.jsonl"]


# --- the command line: validation before generation, exit codes -----------------------------------------------


def _bad_file(tmp_path: pathlib.Path) -> str:
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": "ok too"}\n{"prompt": "x", "top_k": "many"}\n')
    return str(path)


@pytest.mark.parametrize("mode", [["--server", UNREACHABLE], ["--offline"]])
def test_bad_line_stops_the_run_before_anything_starts(tmp_path, capsys, mode) -> None:
    out = tmp_path / "out.jsonl"
    code = cli_main(["generate", *mode, "--input", _bad_file(tmp_path), "--output", str(out)])
    err = capsys.readouterr().err
    # Not UNAVAILABLE and no model load: the third line was rejected first.
    assert code == 2
    assert err.strip().splitlines() == [
        f"tandem: error: {tmp_path}/in.jsonl line 3: top_k: must be an integer, got 'many'"
    ]
    assert not out.exists()


def test_offline_range_error_is_reported_before_loading_the_model(tmp_path, capsys) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt": "b", "temperature": -1}\n')
    assert cli_main(["generate", "--offline", "--model", "no-such-model", "--input", str(path)]) == 2
    assert "line 2: temperature: must be a finite number >= 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["generate", "--server", UNREACHABLE], "give a PROMPT or --input"),
        (["generate", "--offline", "--concurrency", "4", "hi"], "--concurrency applies to server mode only"),
        (["generate", "--offline", "--timeout", "4", "hi"], "--timeout applies to server mode only"),
        (["generate", "--server", UNREACHABLE, "--logprobs", "-1", "hi"], "sampling.logprobs"),
        (["generate", "--server", UNREACHABLE, ""], "PROMPT: must not be empty"),
        (
            ["generate", "--server", UNREACHABLE, "--logit-bias", "x=1", "hi"],
            "--logit-bias: must be TOKEN_ID=BIAS",
        ),
        (
            ["generate", "--server", UNREACHABLE, "--logit-bias", "5", "hi"],
            "--logit-bias: must be TOKEN_ID=BIAS",
        ),
        (["generate", "--server", UNREACHABLE, "--logit-bias", "5=up", "hi"], "the bias must be a number"),
        (["generate", "--offline", "--model", "no-such-model", "--logit-bias", "5=200", "hi"], "[-100, 100]"),
    ],
)
def test_bad_flags_exit_2_with_one_line(capsys, argv, expected) -> None:
    assert cli_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0]


def test_argparse_rejects_nonsense_numbers() -> None:
    with pytest.raises(SystemExit) as info:
        cli_main(["generate", "--max-tokens", "0", "hi"])
    assert info.value.code == 2


def test_unreachable_server_exits_1(capsys) -> None:
    assert cli_main(["generate", "--server", UNREACHABLE, "--timeout", "5", "--json", "hi"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


# --- offline plumbing with a stand-in LLM (the real engine is tested elsewhere) -------------------------------


class RecordingLLM:
    """Stands in for model_runtime.llm.LLM: echoes each prompt's token ids (text: one id per character)."""

    calls: ClassVar[list] = []

    def __init__(self, model: str) -> None:
        if model == "broken":
            raise ValueError("broken: no such model file")
        self.model = model

    def generate(self, prompts, params, progress=False):
        RecordingLLM.calls.append((self.model, list(prompts), list(params), progress))
        completions = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            ids = (
                list(prompt.token_ids)
                if prompt.token_ids is not None
                else [ord(c) for c in str(prompt.text or prompt.messages)]
            )
            out = ids[: sp.max_tokens]
            reason = "length" if len(ids) > sp.max_tokens else "stop"
            completions.append(Completion(f"offline-{i}", ids, out, "".join(map(chr, out)), reason))
        return completions


@pytest.fixture()
def fake_engine(monkeypatch):
    module = types.ModuleType("model_runtime.llm")
    module.LLM = RecordingLLM  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "model_runtime.llm", module)
    RecordingLLM.calls = []
    return RecordingLLM


def test_offline_input_run_writes_json_in_order(tmp_path, capsys, fake_engine) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt": "abcdef", "max_tokens": 3}\n{"prompt_token_ids": [80, 81]}\n')
    out = tmp_path / "out.jsonl"
    assert (
        cli_main(["generate", "--offline", "--input", str(source), "--output", str(out), "--top-k", "4"]) == 0
    )
    ((model, prompts, params, progress),) = fake_engine.calls
    assert model == "smollm2-135m-instruct" and progress is True
    assert prompts == [PromptInput(text="abcdef"), PromptInput(token_ids=(80, 81))]
    assert params[0] == SamplingParams(temperature=0.0, top_k=4, max_tokens=3)
    assert params[1].max_tokens == 64
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert lines[0] == {
        "prompt_token_ids": [97, 98, 99, 100, 101, 102],
        "token_ids": [97, 98, 99],
        "text": "abc",
        "finish_reason": "length",
    }
    assert lines[1]["text"] == "PQ" and lines[1]["finish_reason"] == "stop"
    assert capsys.readouterr().out == ""


def test_offline_chat_prompt_prints_text(capsys, fake_engine) -> None:
    assert cli_main(["generate", "--offline", "--chat", "--model", "tiny", "--max-tokens", "1000", "Hi"]) == 0
    ((model, prompts, _, progress),) = fake_engine.calls
    assert model == "tiny" and progress is False
    assert prompts == [PromptInput(messages=(EngineChatMessage("user", "Hi"),))]
    assert "ChatMessage(role='user', content='Hi')" in capsys.readouterr().out


def test_offline_bad_model_is_one_line_exit_2(capsys, fake_engine) -> None:
    assert cli_main(["generate", "--offline", "--model", "broken", "hi"]) == 2
    assert capsys.readouterr().err.strip() == "tandem: error: --model broken: broken: no such model file"


# --- serve, and the SDK's import footprint ----------------------------------------------------------------------


def test_serve_without_deploy_serve_says_so(monkeypatch, capsys) -> None:
    monkeypatch.setitem(sys.modules, "deploy.serve", None)  # makes the import fail as if the file were absent
    assert cli_main(["serve"]) == 1
    assert "deploy/serve.py is not installed" in capsys.readouterr().err


def test_serve_forwards_the_config(monkeypatch) -> None:
    seen = []
    module = types.ModuleType("deploy.serve")
    module.main = lambda argv: seen.append(argv) or 0  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "deploy.serve", module)
    assert cli_main(["serve", "--config", "deploy/configs/local.yaml"]) == 0
    assert seen == [["--config", "deploy/configs/local.yaml"]]


def test_sdk_and_cli_import_neither_the_engine_nor_torch() -> None:
    # The SDK's side is also an import-linter contract (pyproject.toml). The CLI's is not a layering rule (the
    # command may import anything) but a start-up one: `--offline` and `serve` import model_runtime and deploy
    # inside the functions that need them, and only a run can tell such an import from a module-level one.
    code = (
        "import sys, tandem_client, tandem_cli.cli\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('model_runtime', 'torch', 'ray'))\n"
        "print(bad)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=pathlib.Path(__file__).resolve().parents[2],
    )
    assert result.stdout.strip() == "[]"


def test_output_record_json_keys() -> None:
    record = OutputRecord((1,), (2,), "é", "stop")
    assert (
        record.to_json()
        == '{"prompt_token_ids": [1], "token_ids": [2], "text": "é", "finish_reason": "stop"}'
    )
