"""The chat panel's message box: a text area where Enter sends and Shift+Enter breaks the line.

ipywidgets' own text boxes cannot tell Enter from Shift+Enter (``Text.on_submit`` is
deprecated and a ``Textarea`` has no submit at all), so this is a small anywidget: the
browser side sends ``{"type": "submit"}`` on Enter and keeps ``value`` in step as the
reader types; the Python side decides what a submit does (:meth:`MessageBox.on_submit`).
"""

from __future__ import annotations

from collections.abc import Callable

import anywidget
import traitlets

_ESM = """
function render({ model, el }) {
  const box = document.createElement("textarea");
  box.className = "kl-message-input";
  box.rows = 2;
  box.style.width = "100%";
  box.style.boxSizing = "border-box";
  box.style.resize = "vertical";
  box.style.fontFamily = "inherit";
  const sync = () => {
    box.placeholder = model.get("placeholder");
    box.disabled = model.get("disabled");
    if (box.value !== model.get("value")) box.value = model.get("value");
  };
  box.addEventListener("input", () => {
    model.set("value", box.value);
    model.save_changes();
  });
  box.addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      model.set("value", box.value);
      model.save_changes();
      model.send({ type: "submit" });
    }
  });
  model.on("change:value", sync);
  model.on("change:disabled", sync);
  model.on("change:placeholder", sync);
  sync();
  el.appendChild(box);
}
export default { render };
"""


class MessageBox(anywidget.AnyWidget):
    """A multi-line message box; Enter submits (:meth:`on_submit`), Shift+Enter is a new
    line. ``value`` is the text typed so far (synced as the reader types)."""

    _esm = _ESM
    value = traitlets.Unicode("").tag(sync=True)
    placeholder = traitlets.Unicode("type a message; Enter sends, Shift+Enter a new line").tag(
        sync=True
    )
    disabled = traitlets.Bool(False).tag(sync=True)

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._submit: list[Callable[[MessageBox], None]] = []
        self.on_msg(self._handle)

    def on_submit(self, callback: Callable[[MessageBox], None]) -> None:
        """Call ``callback(box)`` when the reader presses Enter (or :meth:`submit` runs)."""
        self._submit.append(callback)

    def submit(self) -> None:
        """What Enter does, from Python."""
        for callback in self._submit:
            callback(self)

    def _handle(self, _widget, content, _buffers) -> None:
        if isinstance(content, dict) and content.get("type") == "submit":
            self.submit()
