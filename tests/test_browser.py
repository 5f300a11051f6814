"""The notebooks in a real browser: JupyterLab from this environment, driven by Playwright.

JupyterLab starts on 127.0.0.1 (a free port, a random token) over a temporary folder, with
the project's kernel registered in a temporary prefix and isolated settings; it is stopped
at the end of the module. Each test opens its own copy of ``notebooks/`` (``own_copy``: a
folder of its own under the lab's root), so one test's edits or saves cannot change what
the next one opens.

Every wait is for a condition (a selector, the kernel's idle indicator, the widget's own
state, the server's status API, a file settling), bounded by :data:`BOUND_S`, which only
says when to give up: a busy machine makes the tests slower, not red. Chromium is Debian's
(``/usr/bin/chromium``; ``playwright install`` is not used). Without it the tests skip
locally and FAIL under ``CI=true`` (``.ci/run`` installs it). Screenshots go to
``tests/artifacts/`` (or ``$KAKEYA_LAB_ARTIFACTS``).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from kakeya_lab.notebook_format import KERNEL_NAME, PLOTLY_MIME
from kakeya_lab.notebook_html import export_html

pytestmark = [pytest.mark.browser, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(os.environ.get("KAKEYA_LAB_ARTIFACTS", REPO / "tests" / "artifacts"))
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
BOUND_S = 600  # give up on any one condition after this long (never a pacing delay)
BOUND_MS = BOUND_S * 1000


def _missing(reason: str):
    if IN_CI:
        pytest.fail(f"{reason} (CI=true: the browser tests must run; .ci/run installs chromium)")
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _shot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"))


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        _missing(f"{CHROMIUM} is missing (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("playwright is not installed (pip install -e .[dev])")
    with sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A running JupyterLab: ``(base_url, token, root)``; tests put their own copies of the
    notebooks under ``root`` (:func:`own_copy`)."""
    jupyter = Path(sys.executable).parent / "jupyter"
    if not jupyter.exists():
        _missing(f"{jupyter} is missing (pip install -e .[lab])")
    work = tmp_path_factory.mktemp("lab")
    root = work / "root"
    root.mkdir()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "ipykernel",
            "install",
            "--prefix",
            str(work / "kernels"),
            "--name",
            KERNEL_NAME,
            "--display-name",
            KERNEL_NAME,
        ],
        check=True,
        capture_output=True,
    )
    settings = work / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False})
    )
    env = dict(
        os.environ,
        JUPYTER_PATH=str(work / "kernels" / "share" / "jupyter"),
        JUPYTER_CONFIG_DIR=str(work / "config"),
        JUPYTER_RUNTIME_DIR=str(work / "runtime"),
        JUPYTERLAB_SETTINGS_DIR=str(work / "settings"),
        JUPYTERLAB_WORKSPACES_DIR=str(work / "workspaces"),
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        ),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
    )
    port, token = _free_port(), secrets.token_hex(16)
    args = [
        str(jupyter),
        "lab",
        "--no-browser",
        "--ip=127.0.0.1",
        f"--port={port}",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        "--LabApp.expose_app_in_browser=True",  # window.jupyterapp: run a cell by its index
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        args.append("--allow-root")
    log = open(work / "lab.log", "w")
    proc = subprocess.Popen(
        args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + BOUND_S
        while True:  # until the server answers its status API (or the process ended)
            try:
                urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=BOUND_S)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"JupyterLab did not start; see {work / 'lab.log'}"
                    ) from None
                time.sleep(0.5)
        yield base, token, root
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


@pytest.fixture
def own_copy(lab, request) -> Path:
    """This test's own copy of ``notebooks/`` (with ``data`` beside it, as in the repository)
    in a folder of its own under the lab's root; returns that folder."""
    _, _, root = lab
    name = "".join(c if c.isalnum() else "_" for c in request.node.name)[:60]
    folder = root / f"{name}-{secrets.token_hex(3)}"
    shutil.copytree(
        REPO / "notebooks",
        folder / "notebooks",
        ignore=shutil.ignore_patterns(".ipynb_checkpoints"),
    )
    (folder / "data").symlink_to(REPO / "data")
    return folder


def _api(base: str, token: str, path: str, method: str = "GET"):
    req = urllib.request.Request(
        f"{base}{path}", method=method, headers={"Authorization": f"token {token}"}
    )
    with urllib.request.urlopen(req, timeout=BOUND_S) as resp:
        body = resp.read()
    return json.loads(body) if body else None


def _open(browser, lab, folder: Path, name: str, block_kernels: bool = False):
    """A new page with ``folder/notebooks/name`` open (and only it)."""
    base, token, root = lab
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(BOUND_MS)
    if block_kernels:
        page.route(
            "**/api/sessions**",
            lambda route: route.abort() if route.request.method == "POST" else route.continue_(),
        )
        page.route(
            "**/api/kernels**",
            lambda route: route.abort() if route.request.method == "POST" else route.continue_(),
        )
    where = (folder / "notebooks" / name).relative_to(root).as_posix()
    page.goto(f"{base}/lab/tree/{where}?reset&token={token}")  # only this notebook open
    page.wait_for_selector(".jp-Notebook .jp-Cell")
    return page


def _close(page, lab) -> None:
    """Close the page and shut down every kernel it started (sessions and all)."""
    base, token, _ = lab
    page.close()
    for session in _api(base, token, "/api/sessions"):
        _api(base, token, f"/api/sessions/{session['id']}", method="DELETE")


KERNEL_DIALOG = ".jp-Dialog:has-text('Select Kernel')"
# The open notebook's kernel is connected and idle, asked of its session: the toolbar's
# execution indicator says "idle" while the session is still starting, and a cell run then
# is dropped (each such run waited out a retry).
KERNEL = (
    "const app = window.jupyterapp;"
    " const panel = app && Array.from(app.shell.widgets('main')).find(w => w.sessionContext);"
    " const s = panel && panel.sessionContext; const k = s && s.session && s.session.kernel;"
    " const connected = !!k && s.isReady && k.connectionStatus === 'connected';"
)
KERNEL_IDLE = f"() => {{ {KERNEL} return connected && k.status === 'idle' }}"


def _dismiss(dialog) -> None:
    """Accept ``dialog`` and wait until that very dialog is gone (another may open next)."""
    element = dialog.element_handle()
    dialog.locator("button.jp-mod-accept").click()
    element.wait_for_element_state("hidden")  # a detached element counts as hidden


def _accept_kernel_dialog(page) -> bool:
    """JupyterLab sometimes asks which kernel to start even though the notebook names one:
    accept its choice (the notebook's kernel). Returns whether there was such a dialog."""
    dialog = page.locator(KERNEL_DIALOG)
    if not dialog.count():
        return False
    _dismiss(dialog.first)
    return True


def _wait_kernel_idle(page) -> None:
    """Until the notebook's kernel is connected and idle (accepting a kernel dialog on the
    way)."""
    while True:
        page.wait_for_function(f"() => ({KERNEL_IDLE})() || !!document.querySelector('.jp-Dialog')")
        if _accept_kernel_dialog(page):
            continue
        page.wait_for_function(KERNEL_IDLE)  # another dialog: only the bound ends this wait
        return


RUN_TRIES = 10
RETRY_S = 30  # a run request the notebook has not taken by then was lost: run again


def _run_cell(page, index: int) -> None:
    """Run cell ``index`` and wait until this kernel has run it: its prompt shows a number.

    The committed notebook's prompts already show numbers, so the cell's is cleared first;
    then the cell is made the only selected one and JupyterLab's own run command executed
    (a Shift+Enter follows the notebook's active cell, which could still be another one
    while the click that focused its editor settled, and ran that one). The run waits for
    the kernel's connection (JupyterLab drops a run made while its session is starting); a
    kernel dialog can still swallow one: the prompt then stays blank, or shows ``[*]`` and
    turns blank again, and nothing ran; only then is the cell run again, so it never runs
    twice."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    page.wait_for_function(NOTEBOOK_READY, arg=index)
    for _ in range(RUN_TRIES):
        _accept_kernel_dialog(page)
        page.evaluate(RUN_CELL, index)
        try:
            page.wait_for_function(
                f"i => ({CELL_STATE})(i) !== 'blank'", arg=index, timeout=RETRY_S * 1000
            )
        except PlaywrightTimeout:
            if page.evaluate(CELL_STATE, index) == "blank":
                continue  # never taken: run it again
        page.wait_for_function(f"i => ({CELL_STATE})(i) !== 'running'", arg=index)
        if page.evaluate(CELL_STATE, index) == "done":
            return
    raise AssertionError(f"cell {index} never ran ({RUN_TRIES} tries)")


# The open notebook (the page holds only it), through the app JupyterLab exposes.
NOTEBOOK = (
    "const app = window.jupyterapp;"
    " const panel = Array.from(app.shell.widgets('main')).find(w => w.sessionContext);"
    " const notebook = panel.content;"
)
# The notebook's model is loaded and has a cell i (its first cells are drawn before that),
# and its kernel is connected (a run before that is dropped).
NOTEBOOK_READY = (
    f"i => {{ {KERNEL} return connected && panel.context.isReady"
    " && panel.content.widgets.length > i }"
)
# Cell i's prompt: "done" ([N]), "running" ([*]: running or queued) or "blank". Read from
# the cell's widget: the notebook may have detached the node of a cell out of view.
CELL_STATE = (
    f"i => {{ {NOTEBOOK}"
    " const p = notebook.widgets[i].node.querySelector('.jp-InputPrompt').textContent;"
    r" return /\[\d+\]/.test(p) ? 'done' : /\[\*\]/.test(p) ? 'running' : 'blank' }"
)
# Clear cell i's prompt, select it alone and run it (not awaited: a cell may run long).
RUN_CELL = (
    f"i => {{ {NOTEBOOK}"
    " app.shell.activateById(panel.id);"
    " notebook.widgets[i].model.executionCount = null;"
    " notebook.activeCellIndex = i;"
    " notebook.deselectAll();"
    " void app.commands.execute('notebook:run-cell') }"
)


# A cell's exception: JupyterLab 4 draws a traceback as stderr text (no "error" mime type, so
# a selector for one waited out its whole bound when a cell raised)
RAISED = (
    ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']:has-text('Traceback')"
)


def _wait_for_panel_or_error(page) -> None:
    """Until the chat panel is drawn, failing at once if a cell raised instead."""
    page.wait_for_selector(f".kl-chat-panel, {RAISED}")
    errors = page.locator(RAISED)
    assert not errors.count(), f"a cell raised: {errors.first.inner_text()[-2000:]}"


def _start_panel(page) -> None:
    """In an open 05_chat: run the parameters cell and the panel's cell (the kernel loads
    the model first, however long it takes) until the chat panel is drawn."""
    _wait_kernel_idle(page)
    _run_cell(page, 1)
    _run_cell(page, 2)
    _wait_for_panel_or_error(page)


# the newest reply's token count (the transcript lists the newest first)
NEWEST_TOKENS = (
    "() => { const r = document.querySelector('.kl-chat-panel .kl-reply');"
    " return r ? +r.dataset.tokens : -1 }"
)


def _ask_kernel(page, expression: str, marker: str) -> object:
    """Evaluate ``expression`` in the notebook's kernel, in a new cell at the end, and
    return its value (sent back as JSON after ``marker``)."""
    cells = page.locator(".jp-Notebook .jp-Cell")
    last = cells.count() - 1
    cells.nth(last).locator(".jp-InputPrompt").first.click()  # select it, command mode
    page.keyboard.press("Escape")
    page.keyboard.press("b")  # a new code cell below, selected
    cells.nth(last + 1).locator(".jp-InputArea-editor").click()
    page.keyboard.insert_text(f"import json\nprint({marker!r} + json.dumps({expression}))")
    _run_cell(page, last + 1)
    out = page.locator(".jp-OutputArea-output pre", has_text=marker).first
    out.wait_for()
    return json.loads(out.inner_text().split(marker, 1)[1].strip())


def _type_and_enter(page, box: str, text: str) -> None:
    """Type ``text`` into the message box ``box`` (a selector) and press Enter, as a reader
    does (no Send button)."""
    area = page.locator(f"{box} textarea")
    area.click()
    page.keyboard.insert_text(text)
    page.keyboard.press("Enter")


def test_chat_panel_streams_and_stop_leaves_the_session_holding_the_text_shown(
    browser, lab, own_copy
):
    page = _open(browser, lab, own_copy, "05_chat.ipynb")
    try:
        _start_panel(page)
        _shot(page, "chat-panel-ready")
        page.locator(".kl-message textarea").fill(
            "Tell me a long story about a dragon who guards a library."
        )
        page.locator("button.kl-send").click()
        last_tokens = NEWEST_TOKENS
        page.wait_for_function(f"({last_tokens})() >= 2")
        first_seen = page.evaluate(f"({last_tokens})()")
        page.wait_for_function(f"({last_tokens})() >= {first_seen + 2}")  # it streams
        _shot(page, "chat-streaming")
        page.locator("button.kl-stop").click()
        page.wait_for_selector(".kl-chat-panel .kl-status[data-state='done']")
        _shot(page, "chat-stopped")
        status = page.locator(".kl-chat-panel .kl-status")
        assert status.get_attribute("data-stop-reason") == "stopped"
        assert status.get_attribute("data-undelivered") == "0"
        reply = page.locator(".kl-chat-panel .kl-reply").first  # newest first
        shown = reply.evaluate("e => e.textContent")
        shown_tokens = int(reply.get_attribute("data-tokens"))
        assert shown_tokens < 48 and shown.strip(), "the reply was not stopped mid-stream"
        # ask the kernel what the session holds, in a new cell
        page.locator(".jp-Notebook .jp-Cell").nth(3).locator(
            ".jp-InputPrompt"
        ).first.click()  # select, command mode
        page.keyboard.press("Escape")
        page.keyboard.press("b")  # a new code cell below, selected
        page.locator(".jp-Notebook .jp-Cell").nth(4).locator(".jp-InputArea-editor").click()
        page.keyboard.insert_text(
            "import json\n"
            "held = panel.chat.session_reply_ids()\n"
            "print('SESSION=' + json.dumps({'tokens': len(held), "
            "'text': panel.chat.tokenizer.decode(held, skip_special_tokens=True)}))"
        )
        _run_cell(page, 4)
        out = page.locator(".jp-OutputArea-output pre", has_text="SESSION=").first
        out.wait_for()
        session = json.loads(out.inner_text().split("SESSION=", 1)[1].strip())
        _shot(page, "chat-session-check")
        assert session["tokens"] == shown_tokens
        assert session["text"] == shown
    except Exception:
        _shot(page, "chat-failure")
        raise
    finally:
        _close(page, lab)


def test_chat_panel_follows_the_conversation_enter_sends_exports_and_resets(browser, lab, own_copy):
    """Ten turns sent with Enter: the newest reply stays in view while it streams; the
    exported JSON's token ids are the session's history; New conversation empties the page
    and the session."""
    page = _open(browser, lab, own_copy, "05_chat.ipynb")
    try:
        _start_panel(page)
        replies = ".kl-chat-panel .kl-reply"
        for turn in range(1, 11):
            _type_and_enter(
                page, ".kl-chat-panel .kl-message", f"Say one short thing, number {turn}."
            )
            page.wait_for_function(f"document.querySelectorAll('{replies}').length === {turn}")
            page.wait_for_selector(".kl-chat-panel .kl-status[data-state='done']")
        assert page.locator(".kl-chat-panel .kl-message textarea").input_value() == ""
        _type_and_enter(page, ".kl-chat-panel .kl-message", "Tell me a long story about ships.")
        page.wait_for_function(f"({NEWEST_TOKENS})() >= 3")
        in_view = (
            "() => { const box = document.querySelector('.kl-transcript').getBoundingClientRect();"
            " const r = document.querySelector('.kl-chat-panel .kl-reply').getBoundingClientRect();"
            " return r.bottom <= box.bottom + 1 && r.bottom >= box.top }"
        )
        page.wait_for_function(f"({NEWEST_TOKENS})() >= 8")
        _shot(page, "chat-follows-turn-11")
        assert page.evaluate(in_view), "the streaming reply is out of sight"
        assert page.locator(".kl-user").first.get_attribute("data-turn") == "11"
        page.locator("button.kl-stop").click()
        page.wait_for_selector(".kl-chat-panel .kl-status[data-state='done']")
        page.locator("button.kl-export").click()
        link = page.locator(".kl-export-json")
        link.wait_for()
        exported = page.evaluate(
            "e => JSON.parse(atob(e.href.split(',')[1])).history_token_ids",
            link.element_handle(),
        )
        held = _ask_kernel(
            page,
            "list(panel.chat.store.verifier(panel.chat.session_id).history_token_ids)",
            "HISTORY=",
        )
        assert exported == held and len(held) > 0
        page.locator("button.kl-reset").click()
        page.wait_for_function(f"document.querySelectorAll('{replies}').length === 0")
        after = _ask_kernel(
            page,
            "[len(panel.chat.replies), panel.chat.cache_snapshot().history_tokens]",
            "RESET=",
        )
        assert after == [0, 0]
        _shot(page, "chat-reset")
    except Exception:
        _shot(page, "chat-follow-failure")
        raise
    finally:
        _close(page, lab)


def test_a_draft_models_first_use_shows_loading_and_stop_works(browser, lab, own_copy):
    page = _open(browser, lab, own_copy, "05_chat.ipynb")
    try:
        _start_panel(page)
        spec = "draft:smollm2-135m-instruct:int4"
        page.locator(".kl-chat-panel select").first.select_option(spec)
        _type_and_enter(page, ".kl-chat-panel .kl-message", "Hello there!")
        # the status says "loading" while the draft model loads (the load takes seconds; the
        # status comes back from the kernel at once, before the first token)
        page.wait_for_selector(".kl-chat-panel .kl-status[data-state='loading']")
        _shot(page, "chat-draft-loading")
        assert spec in page.locator(".kl-chat-panel .kl-status").inner_text()
        page.locator("button.kl-stop").click()
        page.wait_for_selector(".kl-chat-panel .kl-status[data-state='done']")
        status = page.locator(".kl-chat-panel .kl-status")
        assert "stopped while loading" in status.inner_text()
        held = _ask_kernel(page, "panel.chat.cache_snapshot().history_tokens", "HELD=")
        assert held == 0  # nothing was sent
    except Exception:
        _shot(page, "chat-draft-failure")
        raise
    finally:
        _close(page, lab)


def test_the_race_view_streams_both_lanes_with_the_same_greedy_tokens(browser, lab, own_copy):
    page = _open(browser, lab, own_copy, "05_chat.ipynb")
    try:
        _start_panel(page)
        _run_cell(page, 13)  # the race view
        page.wait_for_selector(".kl-race")
        _type_and_enter(page, ".kl-race", "Count from one to twenty, in words, commas between.")
        lane = "l => +(document.querySelector(`.kl-lane[data-lane='${l}']`).dataset.tokens)"
        page.wait_for_function(f"({lane})('plain') >= 1 && ({lane})('suffix') >= 1")
        _shot(page, "race-streaming")
        page.wait_for_selector(".kl-race-status[data-state='done']")
        _shot(page, "race-done")
        status = page.locator(".kl-race-status").inner_text()
        assert "the same tokens in both lanes" in status, status
        lanes = page.locator(".kl-lane")
        plain, spec = (lanes.nth(i).inner_text().split("\n", 1)[1] for i in range(2))
        assert plain == spec and plain.strip()
    except Exception:
        _shot(page, "race-failure")
        raise
    finally:
        _close(page, lab)


def test_the_monitor_follows_a_running_long_run(browser, lab, own_copy):
    page = _open(browser, lab, own_copy, "25_monitor.ipynb")
    try:
        _wait_kernel_idle(page)
        _run_cell(page, 1)
        _run_cell(page, 2)  # starts a small long run on the command line and the monitor
        page.wait_for_selector(".kl-monitor")
        points = (
            "() => { const p = document.querySelector('.kl-monitor .js-plotly-plot');"
            " return p && p.calcdata && p.calcdata.length ? p.calcdata[0].length : 0 }"
        )
        page.wait_for_function(f"({points})() >= 1")
        first = page.evaluate(points)
        _shot(page, "monitor-first")
        page.wait_for_function(f"({points})() > {first}")  # the figure grows as turns land
        page.wait_for_selector(".kl-monitor-status[data-state='ended']")
        _shot(page, "monitor-ended")
        assert page.evaluate(points) == 8 > first
    except Exception:
        _shot(page, "monitor-failure")
        raise
    finally:
        _close(page, lab)


def test_cache_explorer_moves_with_no_kernel_running(browser, lab, own_copy):
    base, token, _ = lab
    assert _api(base, token, "/api/kernels") == []
    # The page may not start a kernel: JupyterLab would start the notebook's on open.
    page = _open(browser, lab, own_copy, "10_sink_window_cache.ipynb", block_kernels=True)
    try:
        dialog = page.locator(".jp-Dialog")
        dialog.first.wait_for()  # "Error Starting Kernel": the session request was refused
        _shot(page, "cache-explorer-no-kernel-dialog")
        for _ in range(20):  # one per refused attempt; dismiss each until none is left
            if not dialog.count():
                break
            _dismiss(dialog.first)
        else:
            raise AssertionError("kernel-error dialogs keep coming")
        explorer = page.locator(".js-plotly-plot", has_text="Cache explorer").first
        explorer.scroll_into_view_if_needed()
        title = explorer.locator(".gtitle")
        before = title.text_content()
        assert before.startswith("Cache explorer") and "step 23" in before, before
        _shot(page, "cache-explorer-last-step")
        rail = explorer.locator(".slider-rail-rect").first
        box = rail.bounding_box()
        page.mouse.click(box["x"] + 0.12 * box["width"], box["y"] + box["height"] / 2)
        page.wait_for_function(
            "e => !e.textContent.includes('step 23')", arg=title.element_handle()
        )
        after = title.text_content()
        _shot(page, "cache-explorer-moved")
        legend = explorer.locator(".legend").bounding_box()
        grid = explorer.locator(".nsewdrag").first.bounding_box()
        assert legend["x"] >= grid["x"] + grid["width"], "the legend covers the grid"
        assert after != before and "evicted" in after
        assert _api(base, token, "/api/kernels") == [], (
            "a kernel started: the explorer must not need one"
        )
    except Exception:
        _shot(page, "cache-explorer-failure")
        raise
    finally:
        _close(page, lab)


def _settled_bytes(path: Path, timeout_s: float = BOUND_S) -> bytes:
    """The file once the server has finished writing it (complete JSON, unchanged twice)."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        data = path.read_bytes()
        try:
            json.loads(data)
            if data == last:
                return data
        except ValueError:
            pass
        assert time.monotonic() < deadline, f"{path.name} never settled after saving"
        last = data
        time.sleep(0.3)


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "notebooks").glob("*.ipynb")))
def test_open_and_save_leaves_the_notebook_unchanged(browser, lab, own_copy, name):
    path = own_copy / "notebooks" / name
    original = (REPO / "notebooks" / name).read_bytes()
    assert path.read_bytes() == original  # its own copy, whatever other tests did
    before = path.stat().st_mtime_ns
    page = _open(browser, lab, own_copy, name)
    try:
        _wait_kernel_idle(page)
        page.locator(".jp-Notebook:visible .jp-Cell").first.click()
        page.keyboard.press("Control+s")
        deadline = time.monotonic() + BOUND_S
        while path.stat().st_mtime_ns == before:
            assert time.monotonic() < deadline, "JupyterLab did not save the notebook"
            time.sleep(0.2)
        saved = _settled_bytes(path)
        _shot(page, f"saved-{Path(name).stem}")
        assert saved == original, f"open-and-save changed {name}"
    finally:
        _close(page, lab)


def _figure_count(notebook: Path) -> int:
    cells = json.loads(notebook.read_text())["cells"]
    return sum(PLOTLY_MIME in o.get("data", {}) for c in cells for o in c.get("outputs", []))


def test_html_export_shows_the_figures_offline(browser, tmp_path):
    """``make html`` of the committed notebooks (one plotly.min.js beside the pages), each
    page opened with every network request refused: every figure draws, and the cache
    explorer's slider moves."""
    pages = {
        path.stem: (export_html(path, tmp_path), _figure_count(path))
        for path in sorted((REPO / "notebooks").glob("*.ipynb"))
        if _figure_count(path)
    }
    assert "10_sink_window_cache" in pages and len(list(tmp_path.glob("*.js"))) == 1
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(BOUND_MS)
    try:
        page.route(
            "**/*",
            lambda route: (
                route.continue_() if route.request.url.startswith("file:") else route.abort()
            ),
        )
        for name, (html, figures) in pages.items():
            page.goto(html.as_uri())
            drawn = (
                "[...document.querySelectorAll('.plotly-graph-div')]"
                ".filter(d => d.querySelector('.main-svg')).length"
            )
            page.wait_for_function(f"{drawn} >= {figures}")
            assert page.locator(".plotly-graph-div").count() == figures, name
        page.goto(pages["10_sink_window_cache"][0].as_uri())
        plots = page.locator(".js-plotly-plot")
        plots.first.wait_for()
        assert plots.count() == 2  # the NLL curves and the cache explorer
        explorer = page.locator(".js-plotly-plot", has_text="Cache explorer").first
        explorer.scroll_into_view_if_needed()
        title = explorer.locator(".gtitle")
        before = title.text_content()
        rail = explorer.locator(".slider-rail-rect").first
        box = rail.bounding_box()
        page.mouse.click(box["x"] + 0.5 * box["width"], box["y"] + box["height"] / 2)
        page.wait_for_function(
            "([e, t]) => e.textContent !== t",
            arg=[title.element_handle(), before],
        )
        _shot(page, "html-export-explorer")
        assert "step 23" in before and "step 23" not in title.text_content()
    finally:
        page.close()
