"""Served sessions: a gRPC session API and an OpenAI-compatible HTTP endpoint.

``kakeya-lab serve`` runs both in one process over one
:class:`~kakeya_lab.session.SessionStore` (docs/design.md, "Served sessions"):

* :mod:`~kakeya_lab.serve.grpc_service` — CreateSession, AppendTokens, Generate (streaming),
  GetSessionInfo, CloseSession (``proto/session.proto``);
* :mod:`~kakeya_lab.serve.http_app` — the HTTP routes: ``/v1/chat/completions`` with
  prefix reuse, ``/v1/models``, ``/health``, ``/metrics``; the wire format is
  :mod:`~kakeya_lab.serve.openai_protocol`, the work :mod:`~kakeya_lab.serve.http_handlers`;
* :mod:`~kakeya_lab.serve.sessions` — the serving layer both share (reuse, limits,
  cancellation), on the store's own session table;
  :mod:`~kakeya_lab.serve.admission` — reject or queue when full;
  :mod:`~kakeya_lab.serve.served_proposers` — what a request may name as its proposer (the
  model-free kinds, the draft models loaded once with ``--draft``);
  :mod:`~kakeya_lab.serve.metrics` — Prometheus metrics;
* :mod:`~kakeya_lab.serve.server` — both servers, the progress line, SIGTERM;
* :mod:`~kakeya_lab.serve.client` — a small gRPC client for notebooks and benches.

The stubs in ``proto/`` are generated and committed. After editing ``session.proto``,
regenerate them from the repository root with::

    python -m grpc_tools.protoc -I . --python_out=. --grpc_python_out=. --pyi_out=. \\
        kakeya_lab/serve/proto/session.proto

(``tests/test_serve_proto.py`` checks that this reproduces the committed files.)
Importing this package needs the ``serve`` extra (grpcio, fastapi, uvicorn,
prometheus-client); the modules are imported lazily by the CLI.
"""

PROTO_PATH = "kakeya_lab/serve/proto/session.proto"
PROTOC_ARGS = ["-I", ".", "--python_out=.", "--grpc_python_out=.", "--pyi_out=.", PROTO_PATH]
