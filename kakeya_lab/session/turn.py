"""The one chat-turn loop: a user message through the chat template into a session, the
reply's events, and the reply recorded back in the template.

Every chat front end (the chat command, the chat panel, the server's text sessions, the
long-run and speculative benches) goes through these three pieces, so the template always
holds exactly what the session holds:

* :func:`append_message` renders a message with :class:`~kakeya_lab.chat.ChatTemplate` and
  appends its ids, all-or-nothing (the template is unchanged unless the append succeeds);
* :class:`ChatTurn` wraps a generate stream; on every exit (the end, ``close()``, an error)
  it closes the stream and records the delivered tokens as the assistant reply;
* :func:`chat_turn` is both: one user turn, then its reply as a :class:`ChatTurn`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Literal

from kakeya_lab.chat import ChatTemplate
from kakeya_lab.session.events import Done, Event, Token
from kakeya_lab.session.records import AppendResult
from kakeya_lab.session.store import SessionStore
from kakeya_lab.session.stream import GenerationStream


def append_message(
    store: SessionStore,
    session_id: str,
    chat: ChatTemplate,
    role: Literal["user", "assistant"],
    text: str,
    *,
    prefix_ids: Sequence[int] = (),
    check_ids: Callable[[list[int]], list[int]] | None = None,
) -> tuple[list[int], AppendResult]:
    """Render ``text`` as a ``role`` message with ``chat`` and append ``prefix_ids`` plus its
    ids to the session in one append; returns the message's ids and the append's result.

    ``check_ids`` may refuse the ids to append (raise) before the store sees them. On any
    failure ``chat`` is restored, so it never holds a message the session does not.
    """
    if role not in ("user", "assistant"):
        raise ValueError(f"role must be 'user' or 'assistant', got {role!r}")
    saved = chat.to_state()
    try:
        ids = list(chat.user(text) if role == "user" else chat.assistant(text))
        to_append = list(prefix_ids) + ids
        if check_ids is not None:
            to_append = check_ids(to_append)
        return ids, store.append(session_id, to_append)
    except BaseException:
        chat.messages, chat.rendered = saved["messages"], saved["rendered"]
        chat.awaiting_reply = saved["awaiting_reply"]
        raise


class ChatTurn(Iterator[Event]):
    """The events of one reply, recorded in the chat template when the stream ends.

    Iterate it like the store's stream. When it ends, fails or is closed, the stream is
    closed (the session keeps exactly the delivered tokens) and, if ``chat`` awaits a
    reply, the delivered tokens are recorded as the assistant's reply (:attr:`text`).
    ``token_ids`` are the delivered tokens, ``done`` the final event (None if the stream
    was cut short), ``prompt_ids``/``appended`` the user turn (when :func:`chat_turn` made it).
    """

    def __init__(
        self,
        stream: GenerationStream,
        chat: ChatTemplate | None,
        eos_token_ids: Collection[int],
        *,
        prompt_ids: Sequence[int] = (),
        appended: AppendResult | None = None,
    ):
        self.stream = stream
        self.chat = chat if chat is not None and chat.awaiting_reply else None
        self.eos_token_ids = frozenset(eos_token_ids)
        self.prompt_ids = list(prompt_ids)
        self.appended = appended
        self.token_ids: list[int] = []
        self.done: Done | None = None
        self.text: str | None = None  # the reply's text once recorded in the template
        self._closed = False

    def __iter__(self) -> ChatTurn:
        return self

    def __next__(self) -> Event:
        if self._closed:
            raise StopIteration
        try:
            event = next(self.stream)
            if isinstance(event, Token):
                self.token_ids.append(event.id)
            elif isinstance(event, Done):
                self.done = event
            return event
        except BaseException:  # also an interrupt after the stream handed the event out
            self.close()
            raise

    def retract(self) -> bool:
        """The last token ``next()`` returned never reached its reader: the session does not
        keep it (:meth:`GenerationStream.retract`). Returns whether there was one."""
        if self._closed or not self.stream.retract():
            return False
        self.token_ids.pop()
        return True

    def close(self) -> None:
        """Close the stream and record the delivered tokens in the template. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.stream.close()
        finally:
            # what the session kept (next() may have been interrupted after the stream
            # handed a token out and before it was recorded here)
            self.token_ids = list(self.stream.token_ids)
            if self.chat is not None:
                self.text = self.chat.generated(self.token_ids, eos_token_ids=self.eos_token_ids)

    def __enter__(self) -> ChatTurn:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # never raise from a finaliser
            pass


def chat_turn(
    store: SessionStore,
    session_id: str,
    chat: ChatTemplate,
    text: str,
    max_new_tokens: int,
    *,
    prefix_ids: Sequence[int] = (),
    **generate_options,
) -> ChatTurn:
    """One user turn: append ``text`` (after ``prefix_ids``, e.g. the whole conversation so
    far for a fresh session) through ``chat``, then generate the reply; iterate the
    returned :class:`ChatTurn` for its events. ``generate_options`` go to
    :meth:`SessionStore.generate` (``sampling``, ``proposer``, ``draft_length``, ...). If
    generate refuses to start, the reply is recorded as empty (the template stays in step
    with the session) and the error is raised.
    """
    ids, appended = append_message(store, session_id, chat, "user", text, prefix_ids=prefix_ids)
    try:
        stream = store.generate(session_id, max_new_tokens, **generate_options)
    except BaseException:
        chat.generated([], eos_token_ids=store.eos_token_ids)
        raise
    return ChatTurn(stream, chat, store.eos_token_ids, prompt_ids=ids, appended=appended)
