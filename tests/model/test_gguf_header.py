"""Our struct reader of GGUF headers against the `gguf` package's own GGUFReader, value for value.

The embedded SmolLM2 file is not read here a second time: test_weights (its tensors against transformers') and
test_tokenizer (its vocabulary) cover its header through the same reader, and GGUFReader takes seconds on it."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader

from model_runtime.weights.gguf_header import GGUFHeaderError, read_gguf_header
from tests.model.tiny_models import write_tiny_gguf

pytestmark = pytest.mark.model

ALL_TYPES = (Q.Q4_1, Q.Q8_0, Q.F16, Q.BF16, Q.Q4_0, Q.F32)


def assert_same_as_reader(path: Path) -> None:
    reader = GGUFReader(path)
    header = read_gguf_header(path)
    expected = {key: field.contents() for key, field in reader.fields.items()}
    assert header.metadata == expected
    assert [type(v) for v in header.metadata.values()] == [type(v) for v in expected.values()]
    ours = [(t.name, t.ggml_type, t.dims, t.data_offset, t.nbytes) for t in header.tensors]
    theirs = [
        (t.name, Q(int(t.tensor_type)), tuple(int(d) for d in t.shape), int(t.data_offset), int(t.n_bytes))
        for t in reader.tensors
    ]
    assert ours == theirs


@pytest.mark.parametrize(("arch", "tokenizer"), [("llama", "bpe"), ("qwen2", "spm")])
def test_tiny_gguf_header_matches_the_gguf_reader(tmp_path: Path, arch: str, tokenizer: str) -> None:
    assert_same_as_reader(write_tiny_gguf(tmp_path, arch, tokenizer=tokenizer, qtypes=ALL_TYPES))


def test_bad_headers_are_refused(tmp_path: Path) -> None:
    good = write_tiny_gguf(tmp_path).read_bytes()
    cases = {
        "magic": b"GGML" + good[4:],
        "version": good[:4] + (1).to_bytes(4, "little") + good[8:],
        "truncated": good[:200],
        "empty": b"",
    }
    for name, data in cases.items():
        path = tmp_path / f"{name}.gguf"
        path.write_bytes(data)
        with pytest.raises(GGUFHeaderError):
            read_gguf_header(path)
