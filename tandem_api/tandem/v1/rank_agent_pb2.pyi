from tandem_api.tandem.v1 import kv_pb2 as _kv_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AgentHello(_message.Message):
    __slots__ = ("rank", "port", "receiver_id", "layout_fingerprint", "format", "transports")
    RANK_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    port: int
    receiver_id: bytes
    layout_fingerprint: str
    format: _kv_pb2.KVFormat
    transports: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, rank: _Optional[int] = ..., port: _Optional[int] = ..., receiver_id: _Optional[bytes] = ..., layout_fingerprint: _Optional[str] = ..., format: _Optional[_Union[_kv_pb2.KVFormat, _Mapping]] = ..., transports: _Optional[_Iterable[str]] = ...) -> None: ...

class AgentLease(_message.Message):
    __slots__ = ("seq", "request_id", "handle", "block_ids", "num_tokens", "transport")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    seq: int
    request_id: str
    handle: bytes
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    transport: str
    def __init__(self, seq: _Optional[int] = ..., request_id: _Optional[str] = ..., handle: _Optional[bytes] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., transport: _Optional[str] = ...) -> None: ...

class AgentSend(_message.Message):
    __slots__ = ("request_id", "target", "src_block_ids", "num_tokens", "first_token", "after_step", "timeout_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    AFTER_STEP_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    target: _kv_pb2.KVTarget
    src_block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    first_token: _kv_pb2.KVFirstToken
    after_step: int
    timeout_ms: int
    def __init__(self, request_id: _Optional[str] = ..., target: _Optional[_Union[_kv_pb2.KVTarget, _Mapping]] = ..., src_block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., first_token: _Optional[_Union[_kv_pb2.KVFirstToken, _Mapping]] = ..., after_step: _Optional[int] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class AgentCancel(_message.Message):
    __slots__ = ("request_id", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    message: str
    def __init__(self, request_id: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class AgentOutcome(_message.Message):
    __slots__ = ("request_id", "ok", "failure", "message", "num_bytes")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    FAILURE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    ok: bool
    failure: _kv_pb2.KVFailure
    message: str
    num_bytes: int
    def __init__(self, request_id: _Optional[str] = ..., ok: _Optional[bool] = ..., failure: _Optional[_Union[_kv_pb2.KVFailure, str]] = ..., message: _Optional[str] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class AgentReply(_message.Message):
    __slots__ = ("seq", "error")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    seq: int
    error: str
    def __init__(self, seq: _Optional[int] = ..., error: _Optional[str] = ...) -> None: ...

class AgentMessage(_message.Message):
    __slots__ = ("hello", "lease", "send", "cancel", "outcome", "reply")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    SEND_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REPLY_FIELD_NUMBER: _ClassVar[int]
    hello: AgentHello
    lease: AgentLease
    send: AgentSend
    cancel: AgentCancel
    outcome: AgentOutcome
    reply: AgentReply
    def __init__(self, hello: _Optional[_Union[AgentHello, _Mapping]] = ..., lease: _Optional[_Union[AgentLease, _Mapping]] = ..., send: _Optional[_Union[AgentSend, _Mapping]] = ..., cancel: _Optional[_Union[AgentCancel, _Mapping]] = ..., outcome: _Optional[_Union[AgentOutcome, _Mapping]] = ..., reply: _Optional[_Union[AgentReply, _Mapping]] = ...) -> None: ...
