from tandem.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LendPrefixRequest(_message.Message):
    __slots__ = ("prompt_token_ids", "cache_salt")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class LendPrefixResponse(_message.Message):
    __slots__ = ("kv",)
    KV_FIELD_NUMBER: _ClassVar[int]
    kv: KVLocation
    def __init__(self, kv: _Optional[_Union[KVLocation, _Mapping]] = ...) -> None: ...

class SwitchRoleRequest(_message.Message):
    __slots__ = ("role",)
    ROLE_FIELD_NUMBER: _ClassVar[int]
    role: str
    def __init__(self, role: _Optional[str] = ...) -> None: ...

class SwitchRoleResponse(_message.Message):
    __slots__ = ("address", "worker_id", "moved", "finished", "left", "drain_seconds", "switch_seconds")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MOVED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    LEFT_FIELD_NUMBER: _ClassVar[int]
    DRAIN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SWITCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    address: str
    worker_id: str
    moved: int
    finished: int
    left: int
    drain_seconds: float
    switch_seconds: float
    def __init__(self, address: _Optional[str] = ..., worker_id: _Optional[str] = ..., moved: _Optional[int] = ..., finished: _Optional[int] = ..., left: _Optional[int] = ..., drain_seconds: _Optional[float] = ..., switch_seconds: _Optional[float] = ...) -> None: ...

class MoveRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class MoveResponse(_message.Message):
    __slots__ = ("moved", "seconds", "num_tokens")
    MOVED_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    moved: bool
    seconds: float
    num_tokens: int
    def __init__(self, moved: _Optional[bool] = ..., seconds: _Optional[float] = ..., num_tokens: _Optional[int] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("moved", "finished", "left", "seconds")
    MOVED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    LEFT_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    moved: int
    finished: int
    left: int
    seconds: float
    def __init__(self, moved: _Optional[int] = ..., finished: _Optional[int] = ..., left: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "prefix_kv")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_KV_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    prefix_kv: KVLocation
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., prefix_kv: _Optional[_Union[KVLocation, _Mapping]] = ...) -> None: ...

class KVLocation(_message.Message):
    __slots__ = ("worker_id", "address", "num_tokens", "lease_id", "lease_ttl_ms", "instance_id", "role")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    address: str
    num_tokens: int
    lease_id: str
    lease_ttl_ms: int
    instance_id: str
    role: str
    def __init__(self, worker_id: _Optional[str] = ..., address: _Optional[str] = ..., num_tokens: _Optional[int] = ..., lease_id: _Optional[str] = ..., lease_ttl_ms: _Optional[int] = ..., instance_id: _Optional[str] = ..., role: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_ids", "first_logprobs", "finish_reasons", "kv", "num_cached_tokens", "prompt_logprobs")
    FIRST_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASONS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    first_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    finish_reasons: _containers.RepeatedScalarFieldContainer[str]
    kv: KVLocation
    num_cached_tokens: int
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, first_token_ids: _Optional[_Iterable[int]] = ..., first_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., finish_reasons: _Optional[_Iterable[str]] = ..., kv: _Optional[_Union[KVLocation, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params", "kv", "first_token_ids", "first_logprobs", "resume", "prefix_kv")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    PREFIX_KV_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    kv: KVLocation
    first_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    resume: _containers.RepeatedCompositeFieldContainer[SampleTokens]
    prefix_kv: KVLocation
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., kv: _Optional[_Union[KVLocation, _Mapping]] = ..., first_token_ids: _Optional[_Iterable[int]] = ..., first_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ..., resume: _Optional[_Iterable[_Union[SampleTokens, _Mapping]]] = ..., prefix_kv: _Optional[_Union[KVLocation, _Mapping]] = ...) -> None: ...

class HandOver(_message.Message):
    __slots__ = ("request_id", "tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    tokens: _containers.RepeatedCompositeFieldContainer[SampleTokens]
    def __init__(self, request_id: _Optional[str] = ..., tokens: _Optional[_Iterable[_Union[SampleTokens, _Mapping]]] = ...) -> None: ...

class SampleTokens(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateOnWorkerRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "params")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class StreamRequest(_message.Message):
    __slots__ = ("generate", "decode", "cancel", "handover", "lend", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    HANDOVER_FIELD_NUMBER: _ClassVar[int]
    LEND_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    generate: GenerateOnWorkerRequest
    decode: DecodeRequest
    cancel: str
    handover: HandOver
    lend: str
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, generate: _Optional[_Union[GenerateOnWorkerRequest, _Mapping]] = ..., decode: _Optional[_Union[DecodeRequest, _Mapping]] = ..., cancel: _Optional[str] = ..., handover: _Optional[_Union[HandOver, _Mapping]] = ..., lend: _Optional[str] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class RequestUpdate(_message.Message):
    __slots__ = ("request_id", "done", "error_code", "error_message", "move", "kv", "ready", "rebalance", "operator", "lease_returned", "draining")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MOVE_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    REBALANCE_FIELD_NUMBER: _ClassVar[int]
    OPERATOR_FIELD_NUMBER: _ClassVar[int]
    LEASE_RETURNED_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    done: bool
    error_code: int
    error_message: str
    move: bool
    kv: KVLocation
    ready: bool
    rebalance: bool
    operator: bool
    lease_returned: bool
    draining: bool
    def __init__(self, request_id: _Optional[str] = ..., done: _Optional[bool] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ..., move: _Optional[bool] = ..., kv: _Optional[_Union[KVLocation, _Mapping]] = ..., ready: _Optional[bool] = ..., rebalance: _Optional[bool] = ..., operator: _Optional[bool] = ..., lease_returned: _Optional[bool] = ..., draining: _Optional[bool] = ...) -> None: ...

class TokenColumns(_message.Message):
    __slots__ = ("request_id", "sample_index", "num_tokens", "token_ids", "finish_reason", "num_prompt_tokens", "num_cached_tokens", "with_logprobs", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WITH_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: _containers.RepeatedScalarFieldContainer[str]
    sample_index: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _containers.RepeatedScalarFieldContainer[str]
    num_prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: _containers.RepeatedScalarFieldContainer[int]
    with_logprobs: _containers.RepeatedScalarFieldContainer[bool]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, request_id: _Optional[_Iterable[str]] = ..., sample_index: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[_Iterable[int]] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Iterable[str]] = ..., num_prompt_tokens: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[_Iterable[int]] = ..., with_logprobs: _Optional[_Iterable[bool]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class StreamResponse(_message.Message):
    __slots__ = ("updates", "tokens", "prompt_logprobs", "closing")
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CLOSING_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[RequestUpdate]
    tokens: TokenColumns
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[PromptLogprobs]
    closing: bool
    def __init__(self, updates: _Optional[_Iterable[_Union[RequestUpdate, _Mapping]]] = ..., tokens: _Optional[_Union[TokenColumns, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[PromptLogprobs, _Mapping]]] = ..., closing: _Optional[bool] = ...) -> None: ...

class PromptLogprobs(_message.Message):
    __slots__ = ("request_id", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprobs]
    def __init__(self, request_id: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprobs, _Mapping]]] = ...) -> None: ...

class ClaimLeaseRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class ClaimLeaseResponse(_message.Message):
    __slots__ = ("block_ids", "num_tokens", "prompt_digest", "ttl_ms")
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    prompt_digest: bytes
    ttl_ms: int
    def __init__(self, block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., prompt_digest: _Optional[bytes] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id", "if_unclaimed")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    IF_UNCLAIMED_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    if_unclaimed: bool
    def __init__(self, lease_id: _Optional[str] = ..., if_unclaimed: _Optional[bool] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class RenewLeasesRequest(_message.Message):
    __slots__ = ("lease_ids",)
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lease_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class RenewLeasesResponse(_message.Message):
    __slots__ = ("ttl_ms",)
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    ttl_ms: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ttl_ms: _Optional[_Iterable[int]] = ...) -> None: ...

class PoolDescriptor(_message.Message):
    __slots__ = ("dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "num_blocks", "transport", "handle", "device_index", "owner_pid", "model_kv_heads", "tensor_parallel_size", "tensor_parallel_rank")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_INDEX_FIELD_NUMBER: _ClassVar[int]
    OWNER_PID_FIELD_NUMBER: _ClassVar[int]
    MODEL_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    transport: str
    handle: bytes
    device_index: int
    owner_pid: int
    model_kv_heads: int
    tensor_parallel_size: int
    tensor_parallel_rank: int
    def __init__(self, dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., num_blocks: _Optional[int] = ..., transport: _Optional[str] = ..., handle: _Optional[bytes] = ..., device_index: _Optional[int] = ..., owner_pid: _Optional[int] = ..., model_kv_heads: _Optional[int] = ..., tensor_parallel_size: _Optional[int] = ..., tensor_parallel_rank: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("decode_worker_id", "layout")
    DECODE_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    decode_worker_id: str
    layout: PoolDescriptor
    def __init__(self, decode_worker_id: _Optional[str] = ..., layout: _Optional[_Union[PoolDescriptor, _Mapping]] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("prefill_worker_id", "pool", "instance_id", "rank_pools")
    PREFILL_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_POOLS_FIELD_NUMBER: _ClassVar[int]
    prefill_worker_id: str
    pool: PoolDescriptor
    instance_id: str
    rank_pools: _containers.RepeatedCompositeFieldContainer[PoolDescriptor]
    def __init__(self, prefill_worker_id: _Optional[str] = ..., pool: _Optional[_Union[PoolDescriptor, _Mapping]] = ..., instance_id: _Optional[str] = ..., rank_pools: _Optional[_Iterable[_Union[PoolDescriptor, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted",)
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    aborted: bool
    def __init__(self, aborted: _Optional[bool] = ...) -> None: ...

class WatchKVRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchKVResponse(_message.Message):
    __slots__ = ("reset", "stored", "removed", "block_size", "instance_id", "host_stored", "host_removed", "host_tier_id")
    RESET_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_STORED_FIELD_NUMBER: _ClassVar[int]
    HOST_REMOVED_FIELD_NUMBER: _ClassVar[int]
    HOST_TIER_ID_FIELD_NUMBER: _ClassVar[int]
    reset: bool
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    instance_id: str
    host_stored: _containers.RepeatedScalarFieldContainer[int]
    host_removed: _containers.RepeatedScalarFieldContainer[int]
    host_tier_id: str
    def __init__(self, reset: _Optional[bool] = ..., stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., instance_id: _Optional[str] = ..., host_stored: _Optional[_Iterable[int]] = ..., host_removed: _Optional[_Iterable[int]] = ..., host_tier_id: _Optional[str] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Load(_message.Message):
    __slots__ = ("worker_id", "role", "num_running", "num_waiting", "num_free_blocks", "num_blocks", "num_leases", "block_size", "num_requests", "prefix_cache_queries", "prefix_cache_hits", "dtype", "instance_id", "prompt_tokens_computed", "kv_blocks_pulled", "kv_bytes_pulled", "kv_runs_pulled", "kv_pull_seconds", "draining", "step_seconds", "prompt_token_seconds", "kv_blocks_migrated", "migrations_in", "host_kv_blocks_restored", "host_kv_bytes_used", "host_kv_bytes_allocated", "host_kv_capacity_bytes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_PULLED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PULLED_FIELD_NUMBER: _ClassVar[int]
    KV_RUNS_PULLED_FIELD_NUMBER: _ClassVar[int]
    KV_PULL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_MIGRATED_FIELD_NUMBER: _ClassVar[int]
    MIGRATIONS_IN_FIELD_NUMBER: _ClassVar[int]
    HOST_KV_BLOCKS_RESTORED_FIELD_NUMBER: _ClassVar[int]
    HOST_KV_BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    HOST_KV_BYTES_ALLOCATED_FIELD_NUMBER: _ClassVar[int]
    HOST_KV_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    num_leases: int
    block_size: int
    num_requests: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    dtype: str
    instance_id: str
    prompt_tokens_computed: int
    kv_blocks_pulled: int
    kv_bytes_pulled: int
    kv_runs_pulled: int
    kv_pull_seconds: float
    draining: bool
    step_seconds: float
    prompt_token_seconds: float
    kv_blocks_migrated: int
    migrations_in: int
    host_kv_blocks_restored: int
    host_kv_bytes_used: int
    host_kv_bytes_allocated: int
    host_kv_capacity_bytes: int
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_leases: _Optional[int] = ..., block_size: _Optional[int] = ..., num_requests: _Optional[int] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., dtype: _Optional[str] = ..., instance_id: _Optional[str] = ..., prompt_tokens_computed: _Optional[int] = ..., kv_blocks_pulled: _Optional[int] = ..., kv_bytes_pulled: _Optional[int] = ..., kv_runs_pulled: _Optional[int] = ..., kv_pull_seconds: _Optional[float] = ..., draining: _Optional[bool] = ..., step_seconds: _Optional[float] = ..., prompt_token_seconds: _Optional[float] = ..., kv_blocks_migrated: _Optional[int] = ..., migrations_in: _Optional[int] = ..., host_kv_blocks_restored: _Optional[int] = ..., host_kv_bytes_used: _Optional[int] = ..., host_kv_bytes_allocated: _Optional[int] = ..., host_kv_capacity_bytes: _Optional[int] = ...) -> None: ...
