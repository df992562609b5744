from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVTransport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TRANSPORT_UNSPECIFIED: _ClassVar[KVTransport]
    KV_TRANSPORT_TCP: _ClassVar[KVTransport]
    KV_TRANSPORT_NCCL: _ClassVar[KVTransport]
    KV_TRANSPORT_CUDA_IPC: _ClassVar[KVTransport]

class KVFailure(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_FAILURE_UNSPECIFIED: _ClassVar[KVFailure]
    KV_FAILURE_LAYOUT_MISMATCH: _ClassVar[KVFailure]
    KV_FAILURE_TRANSPORT_MISMATCH: _ClassVar[KVFailure]
    KV_FAILURE_PROTOCOL_ERROR: _ClassVar[KVFailure]
    KV_FAILURE_UNKNOWN_HANDLE: _ClassVar[KVFailure]
    KV_FAILURE_HANDLE_REUSED: _ClassVar[KVFailure]
    KV_FAILURE_HANDLE_MISMATCH: _ClassVar[KVFailure]
    KV_FAILURE_HANDLE_BUSY: _ClassVar[KVFailure]
    KV_FAILURE_DESCRIPTOR_MISMATCH: _ClassVar[KVFailure]
    KV_FAILURE_LEASE_EXPIRED: _ClassVar[KVFailure]
    KV_FAILURE_SENDER_ABORTED: _ClassVar[KVFailure]
    KV_FAILURE_RECEIVER_ABORTED: _ClassVar[KVFailure]
    KV_FAILURE_DEADLINE_EXCEEDED: _ClassVar[KVFailure]
    KV_FAILURE_CONNECT_FAILED: _ClassVar[KVFailure]
    KV_FAILURE_CONNECTION_LOST: _ClassVar[KVFailure]
    KV_FAILURE_PAIR_SETUP_FAILED: _ClassVar[KVFailure]
    KV_FAILURE_TRANSPORT_ERROR: _ClassVar[KVFailure]
    KV_FAILURE_RECEIVER_BUSY: _ClassVar[KVFailure]
    KV_FAILURE_SHUTDOWN: _ClassVar[KVFailure]
    KV_FAILURE_INTERNAL: _ClassVar[KVFailure]
KV_TRANSPORT_UNSPECIFIED: KVTransport
KV_TRANSPORT_TCP: KVTransport
KV_TRANSPORT_NCCL: KVTransport
KV_TRANSPORT_CUDA_IPC: KVTransport
KV_FAILURE_UNSPECIFIED: KVFailure
KV_FAILURE_LAYOUT_MISMATCH: KVFailure
KV_FAILURE_TRANSPORT_MISMATCH: KVFailure
KV_FAILURE_PROTOCOL_ERROR: KVFailure
KV_FAILURE_UNKNOWN_HANDLE: KVFailure
KV_FAILURE_HANDLE_REUSED: KVFailure
KV_FAILURE_HANDLE_MISMATCH: KVFailure
KV_FAILURE_HANDLE_BUSY: KVFailure
KV_FAILURE_DESCRIPTOR_MISMATCH: KVFailure
KV_FAILURE_LEASE_EXPIRED: KVFailure
KV_FAILURE_SENDER_ABORTED: KVFailure
KV_FAILURE_RECEIVER_ABORTED: KVFailure
KV_FAILURE_DEADLINE_EXCEEDED: KVFailure
KV_FAILURE_CONNECT_FAILED: KVFailure
KV_FAILURE_CONNECTION_LOST: KVFailure
KV_FAILURE_PAIR_SETUP_FAILED: KVFailure
KV_FAILURE_TRANSPORT_ERROR: KVFailure
KV_FAILURE_RECEIVER_BUSY: KVFailure
KV_FAILURE_SHUTDOWN: KVFailure
KV_FAILURE_INTERNAL: KVFailure

class KVFormat(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype", "tp_size", "tp_rank", "head_start", "model_kv_heads")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    HEAD_START_FIELD_NUMBER: _ClassVar[int]
    MODEL_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str
    tp_size: int
    tp_rank: int
    head_start: int
    model_kv_heads: int
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., dtype: _Optional[str] = ..., tp_size: _Optional[int] = ..., tp_rank: _Optional[int] = ..., head_start: _Optional[int] = ..., model_kv_heads: _Optional[int] = ...) -> None: ...

class KVRankTarget(_message.Message):
    __slots__ = ("port", "handle", "receiver_id", "layout_fingerprint", "format")
    PORT_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    port: int
    handle: bytes
    receiver_id: bytes
    layout_fingerprint: str
    format: KVFormat
    def __init__(self, port: _Optional[int] = ..., handle: _Optional[bytes] = ..., receiver_id: _Optional[bytes] = ..., layout_fingerprint: _Optional[str] = ..., format: _Optional[_Union[KVFormat, _Mapping]] = ...) -> None: ...

class KVTarget(_message.Message):
    __slots__ = ("host", "port", "handle", "request_id", "layout_fingerprint", "format", "num_blocks", "num_tokens", "transport", "receiver_id", "lease_ttl_ms", "rank_targets", "armed")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    RECEIVER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    RANK_TARGETS_FIELD_NUMBER: _ClassVar[int]
    ARMED_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    handle: bytes
    request_id: str
    layout_fingerprint: str
    format: KVFormat
    num_blocks: int
    num_tokens: int
    transport: KVTransport
    receiver_id: bytes
    lease_ttl_ms: int
    rank_targets: _containers.RepeatedCompositeFieldContainer[KVRankTarget]
    armed: KVArmed
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ..., handle: _Optional[bytes] = ..., request_id: _Optional[str] = ..., layout_fingerprint: _Optional[str] = ..., format: _Optional[_Union[KVFormat, _Mapping]] = ..., num_blocks: _Optional[int] = ..., num_tokens: _Optional[int] = ..., transport: _Optional[_Union[KVTransport, str]] = ..., receiver_id: _Optional[bytes] = ..., lease_ttl_ms: _Optional[int] = ..., rank_targets: _Optional[_Iterable[_Union[KVRankTarget, _Mapping]]] = ..., armed: _Optional[_Union[KVArmed, _Mapping]] = ...) -> None: ...

class KVArmed(_message.Message):
    __slots__ = ("sender_id", "slot", "generation")
    SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    sender_id: bytes
    slot: int
    generation: int
    def __init__(self, sender_id: _Optional[bytes] = ..., slot: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class KVHello(_message.Message):
    __slots__ = ("protocol_version", "instance_id", "format", "layout_fingerprint", "transports", "device_uuid", "pair_ready", "idle_timeout_ms", "lane")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    PAIR_READY_FIELD_NUMBER: _ClassVar[int]
    IDLE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    LANE_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    instance_id: bytes
    format: KVFormat
    layout_fingerprint: str
    transports: _containers.RepeatedScalarFieldContainer[KVTransport]
    device_uuid: str
    pair_ready: bool
    idle_timeout_ms: int
    lane: int
    def __init__(self, protocol_version: _Optional[int] = ..., instance_id: _Optional[bytes] = ..., format: _Optional[_Union[KVFormat, _Mapping]] = ..., layout_fingerprint: _Optional[str] = ..., transports: _Optional[_Iterable[_Union[KVTransport, str]]] = ..., device_uuid: _Optional[str] = ..., pair_ready: _Optional[bool] = ..., idle_timeout_ms: _Optional[int] = ..., lane: _Optional[int] = ...) -> None: ...

class KVBegin(_message.Message):
    __slots__ = ("handle", "request_id", "num_blocks", "num_tokens", "num_bytes", "src_block_ids", "head_begin", "num_heads", "armed_generation")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SRC_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    HEAD_BEGIN_FIELD_NUMBER: _ClassVar[int]
    NUM_HEADS_FIELD_NUMBER: _ClassVar[int]
    ARMED_GENERATION_FIELD_NUMBER: _ClassVar[int]
    handle: bytes
    request_id: str
    num_blocks: int
    num_tokens: int
    num_bytes: int
    src_block_ids: _containers.RepeatedScalarFieldContainer[int]
    head_begin: int
    num_heads: int
    armed_generation: int
    def __init__(self, handle: _Optional[bytes] = ..., request_id: _Optional[str] = ..., num_blocks: _Optional[int] = ..., num_tokens: _Optional[int] = ..., num_bytes: _Optional[int] = ..., src_block_ids: _Optional[_Iterable[int]] = ..., head_begin: _Optional[int] = ..., num_heads: _Optional[int] = ..., armed_generation: _Optional[int] = ...) -> None: ...

class KVPart(_message.Message):
    __slots__ = ("layer_begin", "layer_end", "num_bytes")
    LAYER_BEGIN_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    layer_begin: int
    layer_end: int
    num_bytes: int
    def __init__(self, layer_begin: _Optional[int] = ..., layer_end: _Optional[int] = ..., num_bytes: _Optional[int] = ...) -> None: ...

class KVTokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class KVFirstToken(_message.Message):
    __slots__ = ("token_id", "logprob", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_logprobs: _containers.RepeatedCompositeFieldContainer[KVTokenLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_logprobs: _Optional[_Iterable[_Union[KVTokenLogprob, _Mapping]]] = ...) -> None: ...

class KVDone(_message.Message):
    __slots__ = ("first_token",)
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    first_token: KVFirstToken
    def __init__(self, first_token: _Optional[_Union[KVFirstToken, _Mapping]] = ...) -> None: ...

class KVAck(_message.Message):
    __slots__ = ("num_bytes",)
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_bytes: int
    def __init__(self, num_bytes: _Optional[int] = ...) -> None: ...

class KVAbort(_message.Message):
    __slots__ = ("reason", "message")
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    reason: KVFailure
    message: str
    def __init__(self, reason: _Optional[_Union[KVFailure, str]] = ..., message: _Optional[str] = ...) -> None: ...

class KVError(_message.Message):
    __slots__ = ("code", "message", "drained")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    code: KVFailure
    message: str
    drained: bool
    def __init__(self, code: _Optional[_Union[KVFailure, str]] = ..., message: _Optional[str] = ..., drained: _Optional[bool] = ...) -> None: ...

class KVNcclSetup(_message.Message):
    __slots__ = ("unique_id",)
    UNIQUE_ID_FIELD_NUMBER: _ClassVar[int]
    unique_id: bytes
    def __init__(self, unique_id: _Optional[bytes] = ...) -> None: ...

class KVIpcExport(_message.Message):
    __slots__ = ("mem_handle", "offset", "num_blocks")
    MEM_HANDLE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    mem_handle: bytes
    offset: int
    num_blocks: int
    def __init__(self, mem_handle: _Optional[bytes] = ..., offset: _Optional[int] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class KVPairSetup(_message.Message):
    __slots__ = ("nccl", "cuda_ipc")
    NCCL_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    nccl: KVNcclSetup
    cuda_ipc: KVIpcExport
    def __init__(self, nccl: _Optional[_Union[KVNcclSetup, _Mapping]] = ..., cuda_ipc: _Optional[_Union[KVIpcExport, _Mapping]] = ...) -> None: ...

class KVPairSetupAck(_message.Message):
    __slots__ = ("doorbell",)
    DOORBELL_FIELD_NUMBER: _ClassVar[int]
    doorbell: KVDoorbell
    def __init__(self, doorbell: _Optional[_Union[KVDoorbell, _Mapping]] = ...) -> None: ...

class KVDoorbell(_message.Message):
    __slots__ = ("shm_name", "slots", "capacity")
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    shm_name: str
    slots: int
    capacity: int
    def __init__(self, shm_name: _Optional[str] = ..., slots: _Optional[int] = ..., capacity: _Optional[int] = ...) -> None: ...

class KVFrame(_message.Message):
    __slots__ = ("hello", "begin", "pair_setup", "pair_setup_ack", "part", "done", "ack", "abort", "error")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    PAIR_SETUP_FIELD_NUMBER: _ClassVar[int]
    PAIR_SETUP_ACK_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    hello: KVHello
    begin: KVBegin
    pair_setup: KVPairSetup
    pair_setup_ack: KVPairSetupAck
    part: KVPart
    done: KVDone
    ack: KVAck
    abort: KVAbort
    error: KVError
    def __init__(self, hello: _Optional[_Union[KVHello, _Mapping]] = ..., begin: _Optional[_Union[KVBegin, _Mapping]] = ..., pair_setup: _Optional[_Union[KVPairSetup, _Mapping]] = ..., pair_setup_ack: _Optional[_Union[KVPairSetupAck, _Mapping]] = ..., part: _Optional[_Union[KVPart, _Mapping]] = ..., done: _Optional[_Union[KVDone, _Mapping]] = ..., ack: _Optional[_Union[KVAck, _Mapping]] = ..., abort: _Optional[_Union[KVAbort, _Mapping]] = ..., error: _Optional[_Union[KVError, _Mapping]] = ...) -> None: ...
