"""Interactive views for notebooks.

* :mod:`~kakeya_lab.widgets.cache_explorer` — which tokens a sink-window cache holds at
  each step, as a plotly figure with precomputed slider frames (moves without a kernel,
  in committed output and in the HTML export);
* :mod:`~kakeya_lab.widgets.live_chat` — a conversation with a session, one reply at a
  time streamed on a background thread and stoppable mid-reply (no UI);
* :mod:`~kakeya_lab.widgets.chat_panel` — :class:`ChatPanel`, the ipywidgets view of a
  live chat: streamed tokens, Stop, proposer and sampling selectors, new conversation,
  export, cache strip, latency sparkline;
* :mod:`~kakeya_lab.widgets.race` — :class:`RaceView`, one message answered by plain
  decoding and by a proposer side by side, live, with the speedup so far;
* :mod:`~kakeya_lab.widgets.monitor` — :class:`RunMonitor` and :class:`ServerMonitor`,
  live figures of a running long run's folder or a server's ``/metrics``;
* :mod:`~kakeya_lab.widgets.message_box` — the panel's message box (Enter sends).
"""

from kakeya_lab.widgets.cache_explorer import (
    cache_explorer_figure,
    cache_status,
    record_cache_steps,
)
from kakeya_lab.widgets.chat_panel import ChatPanel
from kakeya_lab.widgets.live_chat import LiveChat, ReplyRecord
from kakeya_lab.widgets.monitor import RunMonitor, ServerMonitor
from kakeya_lab.widgets.race import Race, RaceView

__all__ = [
    "ChatPanel",
    "LiveChat",
    "Race",
    "RaceView",
    "ReplyRecord",
    "RunMonitor",
    "ServerMonitor",
    "cache_explorer_figure",
    "cache_status",
    "record_cache_steps",
]
