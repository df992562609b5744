from tandem_api.tandem.v1 import admin_pb2 as _admin_pb2
from tandem_api.tandem.v1 import generate_pb2 as _generate_pb2
from tandem_api.tandem.v1 import kv_pb2 as _kv_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PriorityClass(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_CLASS_NORMAL: _ClassVar[PriorityClass]
    PRIORITY_CLASS_INTERACTIVE: _ClassVar[PriorityClass]
    PRIORITY_CLASS_BATCH: _ClassVar[PriorityClass]
PRIORITY_CLASS_NORMAL: PriorityClass
PRIORITY_CLASS_INTERACTIVE: PriorityClass
PRIORITY_CLASS_BATCH: PriorityClass

class EngineSampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "max_tokens", "stop_token_ids", "ignore_eos", "logprobs", "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty", "prompt_logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    max_tokens: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    prompt_logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., max_tokens: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., prompt_logprobs: _Optional[int] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "target", "output_offset", "priority")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: EngineSampling
    target: _kv_pb2.KVTarget
    output_offset: int
    priority: PriorityClass
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[EngineSampling, _Mapping]] = ..., target: _Optional[_Union[_kv_pb2.KVTarget, _Mapping]] = ..., output_offset: _Optional[int] = ..., priority: _Optional[_Union[PriorityClass, str]] = ...) -> None: ...

class PrefillEvent(_message.Message):
    __slots__ = ("first_token", "transfer_done")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_DONE_FIELD_NUMBER: _ClassVar[int]
    first_token: FirstToken
    transfer_done: TransferDone
    def __init__(self, first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., transfer_done: _Optional[_Union[TransferDone, _Mapping]] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "logprob", "num_cached_tokens", "finish_reason", "stop_token_id", "prompt_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: _generate_pb2.TokenLogprob
    num_cached_tokens: int
    finish_reason: _generate_pb2.FinishReason
    stop_token_id: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[_Union[_generate_pb2.TokenLogprob, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., finish_reason: _Optional[_Union[_generate_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generate_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class TransferDone(_message.Message):
    __slots__ = ("num_bytes", "seconds")
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    num_bytes: int
    seconds: float
    def __init__(self, num_bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling", "local_prefill", "lease_ttl_ms", "output_offset", "priority", "kv_transport", "kv_sender_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_OFFSET_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    KV_SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: EngineSampling
    local_prefill: bool
    lease_ttl_ms: int
    output_offset: int
    priority: PriorityClass
    kv_transport: _kv_pb2.KVTransport
    kv_sender_id: bytes
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[EngineSampling, _Mapping]] = ..., local_prefill: _Optional[bool] = ..., lease_ttl_ms: _Optional[int] = ..., output_offset: _Optional[int] = ..., priority: _Optional[_Union[PriorityClass, str]] = ..., kv_transport: _Optional[_Union[_kv_pb2.KVTransport, str]] = ..., kv_sender_id: _Optional[bytes] = ...) -> None: ...

class DecodeEvent(_message.Message):
    __slots__ = ("reserved", "tokens", "finished")
    RESERVED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    reserved: _kv_pb2.KVTarget
    tokens: TokenBatch
    finished: DecodeFinished
    def __init__(self, reserved: _Optional[_Union[_kv_pb2.KVTarget, _Mapping]] = ..., tokens: _Optional[_Union[TokenBatch, _Mapping]] = ..., finished: _Optional[_Union[DecodeFinished, _Mapping]] = ...) -> None: ...

class TokenBatch(_message.Message):
    __slots__ = ("token_ids", "logprobs", "num_cached_tokens", "prompt_logprobs")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TokenLogprob]
    num_cached_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_generate_pb2.TokenLogprob]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_generate_pb2.TokenLogprob, _Mapping]]] = ..., num_cached_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_generate_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class DecodeFinished(_message.Message):
    __slots__ = ("finish_reason", "stop_token_id", "num_cached_tokens")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: _generate_pb2.FinishReason
    stop_token_id: int
    num_cached_tokens: int
    def __init__(self, finish_reason: _Optional[_Union[_generate_pb2.FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ...) -> None: ...

class WorkerStatusRequest(_message.Message):
    __slots__ = ("known_prefix_version",)
    KNOWN_PREFIX_VERSION_FIELD_NUMBER: _ClassVar[int]
    known_prefix_version: int
    def __init__(self, known_prefix_version: _Optional[int] = ...) -> None: ...

class WorkerEndpoint(_message.Message):
    __slots__ = ("worker_id", "role", "address", "draining")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: _admin_pb2.WorkerRole
    address: str
    draining: bool
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[_admin_pb2.WorkerRole, str]] = ..., address: _Optional[str] = ..., draining: _Optional[bool] = ...) -> None: ...

class WorkerSet(_message.Message):
    __slots__ = ("workers", "generation")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerEndpoint]
    generation: int
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerEndpoint, _Mapping]]] = ..., generation: _Optional[int] = ...) -> None: ...

class SetWorkersReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
