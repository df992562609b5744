"""Input fuzzing against the real service (Ray, gRPC, tcp KV transport, the embedded model).

Every malformed GenerateRequest must end with INVALID_ARGUMENT (or RESOURCE_EXHAUSTED for a message over the size
limit) whose details start with the field at fault; never INTERNAL or UNKNOWN; and the service must still answer
a normal request afterwards. Requests are built as protobuf messages (hypothesis picks which fields to break) or
as raw bytes where protobuf itself cannot express the fault (invalid UTF-8 in a string field, negative ids).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem_api.tandem.v1 import generate_pb2
from tandem_client import Client
from tests.e2e.cluster import ServeProcess

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

GENERATE = "/tandem.v1.Generation/Generate"
CALL_TIMEOUT_S = 30.0
FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
BAD_CODES = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_model_len: int


@dataclass(frozen=True)
class Fault:
    """One broken field: `field` is the prefix the router's details must start with."""

    field: str
    value: object


@pytest.fixture(scope="module")
def cluster(standard_cluster: ServeProcess) -> ServeProcess:
    """The shared standard cluster (tests/e2e/conftest.py): these tests only send it requests."""
    return standard_cluster


@pytest.fixture(scope="module")
def limits(cluster) -> Limits:
    with Client(cluster.address) as client:
        (model,) = client.list_models(timeout=10)
    return Limits(model.vocab_size, model.max_model_len)


@pytest.fixture(scope="module")
def channel(cluster):
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    with grpc.insecure_channel(cluster.address, options=options) as ch:
        yield ch


def call_raw(channel: grpc.Channel, data: bytes) -> tuple[grpc.StatusCode, str]:
    """Send already-serialized request bytes; the final status and its details."""
    call = channel.unary_stream(GENERATE, request_serializer=None, response_deserializer=None)
    try:
        for _ in call(data, timeout=CALL_TIMEOUT_S):
            pass
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def assert_still_serves(address: str) -> None:
    with Client(address) as client:
        result = client.generate("The sky is", temperature=0, max_tokens=3, timeout=60)
    assert result.token_ids, "no tokens from a normal request after the fuzzed ones"


# --- faults protobuf can express -------------------------------------------------------------------------
def sampling_faults(limits: Limits) -> st.SearchStrategy[Fault]:
    floats_bad_temp = st.sampled_from([-1.0, -1e-9, -1e30, math.nan, math.inf, -math.inf])
    floats_bad_top_p = st.sampled_from([0.0, -0.5, 1.0001, 2.0, 1e300, math.nan, math.inf])
    stops_bad = st.sampled_from([[""], ["x" * 257], ["s"] * 17, ["ok", ""]])
    huge_max = st.integers(limits.max_model_len, 2**32 - 1)
    return st.one_of(
        floats_bad_temp.map(lambda v: Fault("sampling.temperature", v)),
        floats_bad_top_p.map(lambda v: Fault("sampling.top_p", v)),
        st.integers(-(2**31), -2).map(lambda v: Fault("sampling.top_k", v)),
        (st.just(0) | huge_max).map(lambda v: Fault("sampling.max_tokens", v)),
        st.integers(21, 2**32 - 1).map(lambda v: Fault("sampling.logprobs", v)),
        stops_bad.map(lambda v: Fault("sampling.stop", v)),
        st.integers(limits.vocab_size, 2**32 - 1).map(lambda v: Fault("sampling.stop_token_ids", [1, v])),
    )


def input_faults(limits: Limits) -> st.SearchStrategy[Fault]:
    oov = st.integers(limits.vocab_size, 2**32 - 1)
    return st.one_of(
        st.just(Fault("input.text", "")),
        st.just(Fault("input.token_ids", [])),
        oov.map(lambda v: Fault("input.token_ids", [1, 2, v])),
        # Oversize prompts: more tokens than the context (plain text tokenizes " word" to one token each).
        st.just(Fault("input", " word" * (limits.max_model_len + 50))),
        st.just(Fault("input", [42] * limits.max_model_len)),
        st.sampled_from(["robot", "", "<|im_start|>system"]).map(lambda r: Fault("input.chat.messages", r)),
        st.just(Fault("input.chat.messages", None)),  # an empty conversation
    )


def other_faults() -> st.SearchStrategy[Fault]:
    return st.one_of(
        st.sampled_from(["", "r" * 129, "id\x00x", "tab\there"]).map(lambda v: Fault("request_id", v)),
        st.just(Fault("model", "no-such-model")),
    )


def apply_fault(request: generate_pb2.GenerateRequest, fault: Fault) -> None:
    name, value = fault.field, fault.value
    if name.startswith("sampling."):
        attr = name.removeprefix("sampling.")
        if isinstance(value, list):
            getattr(request.sampling, attr).extend(value)
        else:
            setattr(request.sampling, attr, value)
    elif name == "input.text" or (name == "input" and isinstance(value, str)):
        request.text = str(value)
    elif name == "input.token_ids" or name == "input":
        request.token_ids.SetInParent()
        request.token_ids.ids.extend(value)  # type: ignore[arg-type]
    elif name == "input.chat.messages":
        request.chat.SetInParent()
        if value is not None:
            request.chat.messages.add(role=str(value), content="hello")
    else:
        setattr(request, name, value)


@st.composite
def bad_requests(draw: st.DrawFn, limits: Limits) -> tuple[generate_pb2.GenerateRequest, list[Fault]]:
    """A request with 1-4 broken fields: up to two sampling faults, at most one prompt fault (the prompt is a
    oneof), at most one of request_id/model."""
    faults = draw(st.lists(sampling_faults(limits), max_size=2, unique_by=lambda f: f.field))
    prompt = draw(st.none() | input_faults(limits))
    other = draw(st.none() | other_faults())
    faults += [f for f in (prompt, other) if f is not None]
    if not faults:
        faults = [draw(sampling_faults(limits))]
    request = generate_pb2.GenerateRequest()
    if prompt is None:
        request.text = draw(st.sampled_from(["Hello", "Why is the sky blue?"]))
    request.sampling.max_tokens = 4  # a fault on max_tokens overrides this
    for fault in faults:
        apply_fault(request, fault)
    return request, faults


def test_malformed_requests_name_the_field_and_never_fail_inside(cluster, limits, channel):
    @FUZZ
    @given(case=bad_requests(limits))
    def check(case: tuple[generate_pb2.GenerateRequest, list[Fault]]) -> None:
        request, faults = case
        code, details = call_raw(channel, request.SerializeToString())
        fields = [f.field for f in faults]
        allowed = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
        if "model" in fields:
            allowed.add(grpc.StatusCode.NOT_FOUND)  # generate.proto: an unknown model is NOT_FOUND
        assert code in allowed, f"{fields}: got {code.name}: {details}"
        assert any(details.startswith(f) for f in fields), f"{fields}: details do not name them: {details}"

    check()
    assert_still_serves(cluster.address)


# --- faults only raw bytes can express -------------------------------------------------------------------
def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative numbers as protobuf writes them: 10-byte two's complement
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (string, bytes, submessage, packed repeated)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


INVALID_UTF8 = st.binary(min_size=1, max_size=24).filter(lambda b: not _is_utf8(b))
SAMPLING_MAX_TOKENS_4 = _varint(5 << 3) + _varint(4)


def raw_with_bad_utf8(where: str, blob: bytes) -> bytes:
    """GenerateRequest bytes whose `where` string holds `blob` (fields: request_id 2, text 3, chat 5,
    sampling 6; in SamplingParams stop is 6; in ChatMessage content is 2)."""
    text = _field(3, b"Hello")
    if where == "text":
        return _field(3, blob) + _field(6, SAMPLING_MAX_TOKENS_4)
    if where == "stop":
        return text + _field(6, SAMPLING_MAX_TOKENS_4 + _field(6, blob))
    if where == "request_id":
        return _field(2, blob) + text + _field(6, SAMPLING_MAX_TOKENS_4)
    message = _field(1, b"user") + _field(2, blob)
    return _field(5, _field(1, message)) + _field(6, SAMPLING_MAX_TOKENS_4)


def test_invalid_utf8_in_string_fields_is_invalid_argument(cluster, channel):
    @FUZZ
    @given(blob=INVALID_UTF8, where=st.sampled_from(["stop", "text", "request_id", "chat"]))
    def check(blob: bytes, where: str) -> None:
        code, details = call_raw(channel, raw_with_bad_utf8(where, blob))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{where}={blob!r}: {code.name}: {details}"
        assert details.startswith("request:") and "UTF-8" in details, details

    check()
    assert_still_serves(cluster.address)


def test_negative_token_ids_are_outside_the_vocabulary(cluster, channel):
    """uint32 on the wire: a negative id written as a 10-byte varint arrives as a huge id, and is refused."""
    for bad in (-1, -(2**31), -7):
        ids = _varint(1) + _varint(bad)
        data = _field(4, _field(1, ids)) + _field(6, SAMPLING_MAX_TOKENS_4)
        code, details = call_raw(channel, data)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{bad}: {code.name}: {details}"
        assert details.startswith("input.token_ids:") and "outside the vocabulary" in details, details
    assert_still_serves(cluster.address)


def test_garbage_bytes_are_invalid_argument(cluster, channel):
    for data in (b"\xff\xff\xff\xff", b"\x1a\x7fshort", _field(6, b"\x0b\x0c")):
        code, details = call_raw(channel, data)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, f"{data!r}: {code.name}: {details}"
    assert_still_serves(cluster.address)


def test_a_message_over_the_size_limit_is_resource_exhausted(cluster, channel):
    """The router's limit is 64 MiB (router.config.DEFAULT_MAX_MESSAGE_BYTES); gRPC refuses the message
    before the router parses it, so no prompt of that size is ever tokenized."""
    from router.config import DEFAULT_MAX_MESSAGE_BYTES

    data = _field(3, b"a" * (DEFAULT_MAX_MESSAGE_BYTES + 1024))
    code, details = call_raw(channel, data)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, f"{code.name}: {details}"
    assert "larger than max" in details or "message" in details.lower(), details
    assert_still_serves(cluster.address)
