from tandem_api.tandem.v1 import kv_pb2 as _kv_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_ROLE_UNSPECIFIED: _ClassVar[WorkerRole]
    WORKER_ROLE_PREFILL: _ClassVar[WorkerRole]
    WORKER_ROLE_DECODE: _ClassVar[WorkerRole]
    WORKER_ROLE_COLOCATED: _ClassVar[WorkerRole]

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_STARTING: _ClassVar[WorkerState]
    WORKER_STATE_READY: _ClassVar[WorkerState]
    WORKER_STATE_DRAINING: _ClassVar[WorkerState]
    WORKER_STATE_DEAD: _ClassVar[WorkerState]
WORKER_ROLE_UNSPECIFIED: WorkerRole
WORKER_ROLE_PREFILL: WorkerRole
WORKER_ROLE_DECODE: WorkerRole
WORKER_ROLE_COLOCATED: WorkerRole
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_STARTING: WorkerState
WORKER_STATE_READY: WorkerState
WORKER_STATE_DRAINING: WorkerState
WORKER_STATE_DEAD: WorkerState

class ScaleRequest(_message.Message):
    __slots__ = ("targets",)
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    targets: _containers.RepeatedCompositeFieldContainer[PoolTarget]
    def __init__(self, targets: _Optional[_Iterable[_Union[PoolTarget, _Mapping]]] = ...) -> None: ...

class PoolTarget(_message.Message):
    __slots__ = ("role", "replicas")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    role: WorkerRole
    replicas: int
    def __init__(self, role: _Optional[_Union[WorkerRole, str]] = ..., replicas: _Optional[int] = ...) -> None: ...

class ScaleReply(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolSize]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolSize, _Mapping]]] = ...) -> None: ...

class PoolSize(_message.Message):
    __slots__ = ("role", "target", "ready", "starting", "draining", "waiting")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TARGET_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    STARTING_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    role: WorkerRole
    target: int
    ready: int
    starting: int
    draining: int
    waiting: str
    def __init__(self, role: _Optional[_Union[WorkerRole, str]] = ..., target: _Optional[int] = ..., ready: _Optional[int] = ..., starting: _Optional[int] = ..., draining: _Optional[int] = ..., waiting: _Optional[str] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("latency_window_seconds",)
    LATENCY_WINDOW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    latency_window_seconds: float
    def __init__(self, latency_window_seconds: _Optional[float] = ...) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("workers", "router", "pools", "autoscaler")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    ROUTER_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    AUTOSCALER_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerInfo]
    router: RouterInfo
    pools: _containers.RepeatedCompositeFieldContainer[PoolSize]
    autoscaler: str
    def __init__(self, workers: _Optional[_Iterable[_Union[WorkerInfo, _Mapping]]] = ..., router: _Optional[_Union[RouterInfo, _Mapping]] = ..., pools: _Optional[_Iterable[_Union[PoolSize, _Mapping]]] = ..., autoscaler: _Optional[str] = ...) -> None: ...

class RouterInfo(_message.Message):
    __slots__ = ("queued_requests", "in_flight_requests", "recent_latency", "active_pairs")
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RECENT_LATENCY_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_PAIRS_FIELD_NUMBER: _ClassVar[int]
    queued_requests: int
    in_flight_requests: int
    recent_latency: RecentLatency
    active_pairs: _containers.RepeatedCompositeFieldContainer[ActivePair]
    def __init__(self, queued_requests: _Optional[int] = ..., in_flight_requests: _Optional[int] = ..., recent_latency: _Optional[_Union[RecentLatency, _Mapping]] = ..., active_pairs: _Optional[_Iterable[_Union[ActivePair, _Mapping]]] = ...) -> None: ...

class ActivePair(_message.Message):
    __slots__ = ("prefill_worker_id", "decode_worker_id", "kv_transport", "nodes", "requests")
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    prefill_worker_id: str
    decode_worker_id: str
    kv_transport: str
    nodes: str
    requests: int
    def __init__(self, prefill_worker_id: _Optional[str] = ..., decode_worker_id: _Optional[str] = ..., kv_transport: _Optional[str] = ..., nodes: _Optional[str] = ..., requests: _Optional[int] = ...) -> None: ...

class RecentLatency(_message.Message):
    __slots__ = ("window_seconds", "ttft_counts", "tpot_counts")
    WINDOW_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TTFT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    TPOT_COUNTS_FIELD_NUMBER: _ClassVar[int]
    window_seconds: float
    ttft_counts: _containers.RepeatedScalarFieldContainer[int]
    tpot_counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, window_seconds: _Optional[float] = ..., ttft_counts: _Optional[_Iterable[int]] = ..., tpot_counts: _Optional[_Iterable[int]] = ...) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("worker_id", "role", "address", "state", "kv_blocks_used", "kv_blocks_total", "running_requests", "waiting_requests", "active_leases", "last_heartbeat_age_seconds", "queued_prefill_tokens", "model", "layout_fingerprint", "requests_total", "kv_block_size", "prefix_cache_version", "cached_block_hashes", "cached_prompt_tokens_total", "indexed_prefix_blocks", "node_id", "kv_transports", "kv_gpu_uuid", "busy_seconds_total", "devices", "kv_sender_id")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_VERSION_FIELD_NUMBER: _ClassVar[int]
    CACHED_BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    INDEXED_PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORTS_FIELD_NUMBER: _ClassVar[int]
    KV_GPU_UUID_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    KV_SENDER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: WorkerRole
    address: str
    state: WorkerState
    kv_blocks_used: int
    kv_blocks_total: int
    running_requests: int
    waiting_requests: int
    active_leases: int
    last_heartbeat_age_seconds: float
    queued_prefill_tokens: int
    model: str
    layout_fingerprint: str
    requests_total: int
    kv_block_size: int
    prefix_cache_version: int
    cached_block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    cached_prompt_tokens_total: int
    indexed_prefix_blocks: int
    node_id: str
    kv_transports: _containers.RepeatedScalarFieldContainer[_kv_pb2.KVTransport]
    kv_gpu_uuid: str
    busy_seconds_total: float
    devices: int
    kv_sender_id: bytes
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[_Union[WorkerRole, str]] = ..., address: _Optional[str] = ..., state: _Optional[_Union[WorkerState, str]] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., active_leases: _Optional[int] = ..., last_heartbeat_age_seconds: _Optional[float] = ..., queued_prefill_tokens: _Optional[int] = ..., model: _Optional[str] = ..., layout_fingerprint: _Optional[str] = ..., requests_total: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., prefix_cache_version: _Optional[int] = ..., cached_block_hashes: _Optional[_Iterable[bytes]] = ..., cached_prompt_tokens_total: _Optional[int] = ..., indexed_prefix_blocks: _Optional[int] = ..., node_id: _Optional[str] = ..., kv_transports: _Optional[_Iterable[_Union[_kv_pb2.KVTransport, str]]] = ..., kv_gpu_uuid: _Optional[str] = ..., busy_seconds_total: _Optional[float] = ..., devices: _Optional[int] = ..., kv_sender_id: _Optional[bytes] = ...) -> None: ...
