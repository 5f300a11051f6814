from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CreateSessionRequest(_message.Message):
    __slots__ = ("system_prompt",)
    SYSTEM_PROMPT_FIELD_NUMBER: _ClassVar[int]
    system_prompt: str
    def __init__(self, system_prompt: _Optional[str] = ...) -> None: ...

class CreateSessionReply(_message.Message):
    __slots__ = ("session_id", "queued_s")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUED_S_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    queued_s: float
    def __init__(self, session_id: _Optional[str] = ..., queued_s: _Optional[float] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AppendRequest(_message.Message):
    __slots__ = ("session_id", "token_ids", "user_text", "assistant_text")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    USER_TEXT_FIELD_NUMBER: _ClassVar[int]
    ASSISTANT_TEXT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_ids: TokenIds
    user_text: str
    assistant_text: str
    def __init__(self, session_id: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., user_text: _Optional[str] = ..., assistant_text: _Optional[str] = ...) -> None: ...

class AppendReply(_message.Message):
    __slots__ = ("appended_tokens", "dropped_tokens", "latency_s", "history_len", "cache_len")
    APPENDED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    HISTORY_LEN_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    appended_tokens: int
    dropped_tokens: int
    latency_s: float
    history_len: int
    cache_len: int
    def __init__(self, appended_tokens: _Optional[int] = ..., dropped_tokens: _Optional[int] = ..., latency_s: _Optional[float] = ..., history_len: _Optional[int] = ..., cache_len: _Optional[int] = ...) -> None: ...

class Sampling(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("session_id", "max_new_tokens", "sampling", "stop_token_ids", "proposer", "draft_length", "adaptive_draft_length", "allow_no_stop")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_DRAFT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ALLOW_NO_STOP_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    max_new_tokens: int
    sampling: Sampling
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    proposer: str
    draft_length: int
    adaptive_draft_length: bool
    allow_no_stop: bool
    def __init__(self, session_id: _Optional[str] = ..., max_new_tokens: _Optional[int] = ..., sampling: _Optional[_Union[Sampling, _Mapping]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., proposer: _Optional[str] = ..., draft_length: _Optional[int] = ..., adaptive_draft_length: _Optional[bool] = ..., allow_no_stop: _Optional[bool] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("id", "text")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    id: int
    text: str
    def __init__(self, id: _Optional[int] = ..., text: _Optional[str] = ...) -> None: ...

class HistoryTruncatedEvent(_message.Message):
    __slots__ = ("dropped",)
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    dropped: int
    def __init__(self, dropped: _Optional[int] = ...) -> None: ...

class SpeculativeStepEvent(_message.Message):
    __slots__ = ("draft_length", "proposed", "accepted", "emitted", "proposer_s", "verifier_s")
    DRAFT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    EMITTED_FIELD_NUMBER: _ClassVar[int]
    PROPOSER_S_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_S_FIELD_NUMBER: _ClassVar[int]
    draft_length: int
    proposed: int
    accepted: int
    emitted: int
    proposer_s: float
    verifier_s: float
    def __init__(self, draft_length: _Optional[int] = ..., proposed: _Optional[int] = ..., accepted: _Optional[int] = ..., emitted: _Optional[int] = ..., proposer_s: _Optional[float] = ..., verifier_s: _Optional[float] = ...) -> None: ...

class DoneEvent(_message.Message):
    __slots__ = ("stop_reason", "generated_tokens", "verifier_forwards", "proposed", "accepted", "history_len", "cache_len", "kv_live_bytes", "total_s", "first_token_s", "tokens_per_s")
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    VERIFIER_FORWARDS_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    HISTORY_LEN_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_LIVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    stop_reason: str
    generated_tokens: int
    verifier_forwards: int
    proposed: int
    accepted: int
    history_len: int
    cache_len: int
    kv_live_bytes: int
    total_s: float
    first_token_s: float
    tokens_per_s: float
    def __init__(self, stop_reason: _Optional[str] = ..., generated_tokens: _Optional[int] = ..., verifier_forwards: _Optional[int] = ..., proposed: _Optional[int] = ..., accepted: _Optional[int] = ..., history_len: _Optional[int] = ..., cache_len: _Optional[int] = ..., kv_live_bytes: _Optional[int] = ..., total_s: _Optional[float] = ..., first_token_s: _Optional[float] = ..., tokens_per_s: _Optional[float] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("token", "truncated", "step", "done")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    token: TokenEvent
    truncated: HistoryTruncatedEvent
    step: SpeculativeStepEvent
    done: DoneEvent
    def __init__(self, token: _Optional[_Union[TokenEvent, _Mapping]] = ..., truncated: _Optional[_Union[HistoryTruncatedEvent, _Mapping]] = ..., step: _Optional[_Union[SpeculativeStepEvent, _Mapping]] = ..., done: _Optional[_Union[DoneEvent, _Mapping]] = ...) -> None: ...

class SessionRef(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class SessionInfoRequest(_message.Message):
    __slots__ = ("session_id", "include_history")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_HISTORY_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    include_history: bool
    def __init__(self, session_id: _Optional[str] = ..., include_history: _Optional[bool] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("session_id", "history_len", "cache_len", "kv_live_bytes", "budget_tokens", "kv_budget_bytes", "turns", "generated_tokens", "appended_tokens", "generations", "prefill_s", "sink", "positions", "history", "proposed", "accepted", "draft_kv_live_bytes")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    HISTORY_LEN_FIELD_NUMBER: _ClassVar[int]
    CACHE_LEN_FIELD_NUMBER: _ClassVar[int]
    KV_LIVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    TURNS_FIELD_NUMBER: _ClassVar[int]
    GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    APPENDED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GENERATIONS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    SINK_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_KV_LIVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    history_len: int
    cache_len: int
    kv_live_bytes: int
    budget_tokens: int
    kv_budget_bytes: int
    turns: int
    generated_tokens: int
    appended_tokens: int
    generations: int
    prefill_s: float
    sink: int
    positions: str
    history: _containers.RepeatedScalarFieldContainer[int]
    proposed: int
    accepted: int
    draft_kv_live_bytes: int
    def __init__(self, session_id: _Optional[str] = ..., history_len: _Optional[int] = ..., cache_len: _Optional[int] = ..., kv_live_bytes: _Optional[int] = ..., budget_tokens: _Optional[int] = ..., kv_budget_bytes: _Optional[int] = ..., turns: _Optional[int] = ..., generated_tokens: _Optional[int] = ..., appended_tokens: _Optional[int] = ..., generations: _Optional[int] = ..., prefill_s: _Optional[float] = ..., sink: _Optional[int] = ..., positions: _Optional[str] = ..., history: _Optional[_Iterable[int]] = ..., proposed: _Optional[int] = ..., accepted: _Optional[int] = ..., draft_kv_live_bytes: _Optional[int] = ...) -> None: ...

class CloseReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
