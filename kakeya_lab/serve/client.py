"""A small gRPC client for the session service (notebooks, benches, tests).

    with SessionClient("127.0.0.1:50051") as client:
        sid = client.create()
        client.append_text(sid, "Hello!")
        reply = client.generate(sid, max_new_tokens=32)   # GeneratedReply
        print(reply.text, client.info(sid).history_len)

Errors arrive as ``grpc.RpcError`` with the status codes listed in
:mod:`kakeya_lab.serve.grpc_service`. A keyed server's key is ``api_key`` or, by default,
``$KAKEYA_LAB_API_KEY``; it is sent with every call (``authorization`` metadata).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import grpc

from kakeya_lab.serve.api_keys import client_key
from kakeya_lab.serve.proto import session_pb2 as pb
from kakeya_lab.serve.proto import session_pb2_grpc as pb_grpc


@dataclass(frozen=True)
class GeneratedReply:
    """A collected Generate stream."""

    token_ids: list[int]
    text: str
    done: pb.DoneEvent | None
    truncated_dropped: int | None


class SessionClient:
    """Thin wrapper over the generated stub (one channel)."""

    def __init__(self, target: str, *, timeout_s: float = 120.0, api_key: str | None = None):
        self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.SessionServiceStub(self.channel)
        self.timeout_s = timeout_s
        key = client_key(api_key)
        self.metadata = (("authorization", f"Bearer {key}"),) if key else ()

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        grpc.channel_ready_future(self.channel).result(timeout=timeout_s)

    def create(self, system_prompt: str | None = None) -> str:
        request = pb.CreateSessionRequest()
        if system_prompt is not None:
            request.system_prompt = system_prompt
        return self.stub.CreateSession(
            request, timeout=self.timeout_s, metadata=self.metadata
        ).session_id

    def append_ids(self, session_id: str, token_ids: Sequence[int]) -> pb.AppendReply:
        return self.stub.AppendTokens(
            pb.AppendRequest(session_id=session_id, token_ids=pb.TokenIds(ids=list(token_ids))),
            timeout=self.timeout_s,
            metadata=self.metadata,
        )

    def append_text(self, session_id: str, text: str, role: str = "user") -> pb.AppendReply:
        field = {"user": "user_text", "assistant": "assistant_text"}[role]
        request = pb.AppendRequest(session_id=session_id)
        setattr(request, field, text)  # one member of the request's text oneof
        return self.stub.AppendTokens(request, timeout=self.timeout_s, metadata=self.metadata)

    def stream(
        self,
        session_id: str,
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        seed: int | None = None,
        proposer: str = "none",
        draft_length: int = 4,
        stop_token_ids: Sequence[int] = (),
        allow_no_stop: bool = False,
    ) -> Iterator[pb.GenerateEvent]:
        """The raw event stream (a call object: ``.cancel()`` stops generation)."""
        sampling = pb.Sampling(temperature=temperature)
        if seed is not None:
            sampling.seed = seed
        return self.stub.Generate(
            pb.GenerateRequest(
                session_id=session_id,
                max_new_tokens=max_new_tokens,
                sampling=sampling,
                proposer=proposer,
                draft_length=draft_length,
                stop_token_ids=list(stop_token_ids),
                allow_no_stop=allow_no_stop,
            ),
            timeout=self.timeout_s,
            metadata=self.metadata,
        )

    def generate(self, session_id: str, max_new_tokens: int, **options) -> GeneratedReply:
        ids: list[int] = []
        texts: list[str] = []
        done = None
        dropped = None
        for event in self.stream(session_id, max_new_tokens, **options):
            kind = event.WhichOneof("event")
            if kind == "token":
                ids.append(event.token.id)
                texts.append(event.token.text)
            elif kind == "truncated":
                dropped = event.truncated.dropped
            elif kind == "done":
                done = event.done
        return GeneratedReply(ids, "".join(texts), done, dropped)

    def info(self, session_id: str, include_history: bool = False) -> pb.SessionInfo:
        return self.stub.GetSessionInfo(
            pb.SessionInfoRequest(session_id=session_id, include_history=include_history),
            timeout=self.timeout_s,
            metadata=self.metadata,
        )

    def close_session(self, session_id: str) -> None:
        self.stub.CloseSession(
            pb.SessionRef(session_id=session_id), timeout=self.timeout_s, metadata=self.metadata
        )

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> SessionClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
