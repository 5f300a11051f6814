"""Interactive views for notebooks (ipywidgets)."""

from __future__ import annotations

import html
from collections.abc import Sequence

from kakeya_lab.verifier import Verifier


def record_cache_steps(verifier: Verifier, token_ids: Sequence[int], chunk: int = 1) -> list[list[int]]:
    """Append ``token_ids`` ``chunk`` at a time; the cached positions after every append."""
    steps = []
    ids = list(token_ids)
    for i in range(0, len(ids), chunk):
        verifier.append(ids[i : i + chunk])
        steps.append(verifier.cached_positions())
    return steps


def render_cache_html(tokenizer, history_ids: Sequence[int], cached: Sequence[int], sink: int) -> str:
    """Tokens seen so far: sinks (blue), window (green), evicted (grey, struck through)."""
    held = set(cached)
    seen = (max(held) + 1) if held else 0
    spans = []
    for pos in range(seen):
        text = html.escape(tokenizer.decode([history_ids[pos]]))
        if pos in held and pos < sink:
            style = "background:#c6dbef"
        elif pos in held:
            style = "background:#c7e9c0"
        else:
            style = "color:#aaa;text-decoration:line-through"
        spans.append(f'<span title="position {pos}" style="{style}">{text}</span>')
    legend = ('<div style="font-size:85%;margin-bottom:4px"><span style="background:#c6dbef">sink</span> '
              '<span style="background:#c7e9c0">window</span> '
              '<span style="color:#aaa;text-decoration:line-through">evicted</span> '
              f'&nbsp; held {len(held)} of {seen} tokens</div>')
    return legend + '<div style="font-family:monospace;white-space:pre-wrap;line-height:1.6">' + "".join(spans) + "</div>"


class CacheExplorer:
    """Step through a session and see which tokens the cache holds at each step."""

    def __init__(self, tokenizer, history_ids: Sequence[int], steps: Sequence[Sequence[int]], sink: int):
        import ipywidgets as w

        self.tokenizer, self.history_ids, self.steps, self.sink = tokenizer, list(history_ids), list(steps), sink
        self.slider = w.IntSlider(value=len(steps) - 1, min=0, max=len(steps) - 1, description="step",
                                  continuous_update=False, layout=w.Layout(width="60%"))
        self.view = w.HTML()
        self.slider.observe(lambda change: self._show(change["new"]), names="value")
        self._show(self.slider.value)
        self.widget = w.VBox([self.slider, self.view])

    def _show(self, step: int) -> None:
        self.view.value = render_cache_html(self.tokenizer, self.history_ids, self.steps[step], self.sink)

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)
