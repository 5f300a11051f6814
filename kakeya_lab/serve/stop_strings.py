"""Stop strings over a streamed reply's text (OpenAI's ``stop``).

The reply's text arrives delta by delta (from the streaming detokenizer); a
:class:`StopMatcher` passes on the text that can no longer be part of a stop string and
holds back a tail that might still become one. When the text contains a stop string the
reply ends there: the stop string and anything after it are never shown.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Detokenized stop-string matching, delta by delta.

    :meth:`feed` takes the next text of the reply and returns the part safe to show;
    :attr:`stopped` turns true once a stop string has appeared (then the generation should
    end); :meth:`flush` returns the held-back tail when the reply ended without a stop.
    Joined, the shown text is the reply up to (excluding) its earliest stop string, as
    the text stood at the delta that first completed one (the generation ends there, so
    a longer stop string that started earlier but would complete later does not count).
    """

    def __init__(self, stops: Sequence[str]):
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop strings must be non-empty strings")
        self.stops = list(stops)
        self.text = ""
        self.shown = 0  # characters of ``text`` returned so far
        self.stopped = False
        self._hold = max((len(s) for s in self.stops), default=1) - 1

    def feed(self, delta: str) -> str:
        """Add ``delta``; the text now safe to show ("" while a stop string may be forming,
        and after a stop)."""
        if self.stopped or not delta:
            return ""
        self.text += delta
        # a stop string cannot start in text already shown (it was checked with enough
        # text after it), so search from there
        hits = [i for i in (self.text.find(s, self.shown) for s in self.stops) if i >= 0]
        if hits:
            end = min(hits)
            self.stopped = True
        else:
            end = len(self.text)
            for start in range(max(self.shown, len(self.text) - self._hold), len(self.text)):
                tail = self.text[start:]
                if any(s.startswith(tail) for s in self.stops):
                    end = start  # might be the start of a stop string: hold it back
                    break
        out = self.text[self.shown : end]
        self.shown = end
        return out

    def flush(self) -> str:
        """The held-back text, once the reply has ended without a stop string."""
        if self.stopped:
            return ""
        out = self.text[self.shown :]
        self.shown = len(self.text)
        return out
