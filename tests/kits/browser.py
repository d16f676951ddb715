"""Headless Chromium driven over the Chrome DevTools protocol (a websocket), for the page's tests and pictures.

    with Browser() as browser:                       # CHROMIUM, a fresh profile, torn down on exit
        browser.open("http://127.0.0.1:8000/")
        browser.press("Tab"); browser.type("a question"); browser.press("Enter")
        browser.wait_for("document.querySelector('#answer-hypic')?.dataset.done")
        browser.screenshot(Path("page.png"), width=320, dark=True)

`chromium_missing()` says why no browser can run here (None when one can). Chromium runs with the flags a closed
network needs: without `--disable-background-networking` and friends its own connections to the outside are
refused and slow it down.
"""

from __future__ import annotations

import base64
import json
import logging
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from hypic_rag.errors import EXIT_FAILURE, HypicError

logger = logging.getLogger(__name__)

CHROMIUM = Path("/usr/bin/chromium")
"""Debian's Chromium (`apt-get install chromium`)."""
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-default-apps", "--disable-extensions", "--mute-audio", "--hide-scrollbars",
                  "--remote-debugging-port=0")
START_TIMEOUT_S = 30.0
KEYS = {
    "Enter": {"key": "Enter", "code": "Enter", "windowsVirtualKeyCode": 13, "text": "\r"},
    "Tab": {"key": "Tab", "code": "Tab", "windowsVirtualKeyCode": 9},
    " ": {"key": " ", "code": "Space", "windowsVirtualKeyCode": 32, "text": " "},
}
"""The keys `Browser.press` knows, as the protocol's `Input.dispatchKeyEvent` takes them."""


class BrowserError(HypicError, RuntimeError):
    """Chromium did not start, a protocol command failed, a page script threw, or a wait ran out (exit code 1)."""

    exit_code = EXIT_FAILURE


def chromium_missing(executable: Path = CHROMIUM) -> str | None:
    """Why no headless Chromium can run here (one line), or None when it can."""
    if not executable.exists():
        return f"{executable} is not installed (apt-get install chromium)"
    try:
        import websockets.sync.client  # noqa: F401
    except ImportError:
        return "the websockets package is not installed (pip install -e '.[test]')"
    return None


class Browser:
    """One headless Chromium with one page, commanded over its DevTools websocket.

    Page scripts' uncaught exceptions are kept in `exceptions` (text), console messages in `console`."""

    def __init__(self, executable: Path = CHROMIUM, *, width: int = 1000, height: int = 800) -> None:
        self.executable = executable
        self.width, self.height = width, height
        self.exceptions: list[str] = []
        self.console: list[str] = []
        self._profile: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._socket: Any = None
        self._next_id = 0

    # ------------------------------------------------------------------------------------------- lifecycle
    def __enter__(self) -> Browser:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None) -> None:
        self.close()

    def start(self) -> None:
        """Start Chromium on a fresh profile and connect to its first page."""
        from websockets.sync.client import connect

        self._profile = Path(tempfile.mkdtemp(prefix="hypic-chromium-"))
        command = [str(self.executable), *CHROMIUM_FLAGS, f"--user-data-dir={self._profile}",
                   f"--window-size={self.width},{self.height}", "about:blank"]
        log = (self._profile / "chromium.log").open("wb")
        self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        port_file = self._profile / "DevToolsActivePort"
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            if self._process.poll() is not None or time.monotonic() > deadline:
                output = (self._profile / "chromium.log").read_text(errors="replace")[-2000:]
                self.close()
                raise BrowserError(f"chromium did not start: {output.strip() or 'no output'}")
            time.sleep(0.05)
        port = int(port_file.read_text().splitlines()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as response:
            targets = json.load(response)
        page = next(target for target in targets if target.get("type") == "page")
        self._socket = connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=10).__enter__()
        self.call("Page.enable")
        self.call("Runtime.enable")
        self.viewport(self.width, self.height)

    def close(self) -> None:
        """Stop Chromium and remove its profile."""
        if self._socket is not None:
            try:
                self._socket.close()
            finally:
                self._socket = None
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait(timeout=10)
            self._process = None
        if self._profile is not None:
            shutil.rmtree(self._profile, ignore_errors=True)
            self._profile = None

    # ------------------------------------------------------------------------------------------- protocol
    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one protocol command and return its result (events that arrive meanwhile are recorded)."""
        if self._socket is None:
            raise BrowserError("the browser is not started")
        self._next_id += 1
        number = self._next_id
        self._socket.send(json.dumps({"id": number, "method": method, "params": params}))
        while True:
            message = json.loads(self._socket.recv(timeout=120))
            if message.get("id") == number:
                if "error" in message:
                    raise BrowserError(f"{method}: {message['error'].get('message', message['error'])}")
                return message.get("result", {})
            self._record(message)

    def _record(self, message: dict[str, Any]) -> None:
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.exceptions.append(str(details.get("exception", {}).get("description") or details.get("text")))
        elif method == "Runtime.consoleAPICalled":
            self.console.append(" ".join(str(arg.get("value", arg.get("description", ""))) for arg in params.get("args", [])))

    # ------------------------------------------------------------------------------------------- the page
    def evaluate(self, expression: str) -> Any:
        """The value of a script expression in the page (promises awaited); BrowserError when it throws."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise BrowserError(f"{expression!r} threw: {details.get('exception', {}).get('description') or details}")
        return result.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout_s: float = 60.0) -> Any:
        """Poll `expression` until it is truthy; its value, or BrowserError after `timeout_s`. The value comes back
        as JSON: an expression giving a DOM node reads as `{}` (falsy here), so test for what the node shows."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"waited {timeout_s} s for {expression!r}; page errors: {self.exceptions}")
            time.sleep(0.05)

    def open(self, url: str, ready: str = "document.body && document.body.dataset.ready === 'true'") -> None:
        """Load `url` and wait until `ready` holds."""
        self.call("Page.navigate", url=url)
        self.wait_for(ready)

    def press(self, key: str) -> None:
        """Press and release one key of `KEYS` in the focused element."""
        fields = KEYS[key]
        self.call("Input.dispatchKeyEvent", type="keyDown", **fields)
        self.call("Input.dispatchKeyEvent", type="keyUp", **{k: v for k, v in fields.items() if k != "text"})

    def type(self, text: str) -> None:
        """Type `text` into the focused element (as an input method would)."""
        self.call("Input.insertText", text=text)

    def viewport(self, width: int, height: int, *, dark: bool = False) -> None:
        """Lay the page out `width` CSS pixels wide, in the light or the dark colour scheme."""
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        self.call("Emulation.setEmulatedMedia", features=[{"name": "prefers-color-scheme",
                                                           "value": "dark" if dark else "light"}])

    def screenshot(self, path: Path, *, width: int | None = None, dark: bool = False, colours: int | None = None) -> Path:
        """The whole page as a PNG at `path`, laid out `width` CSS pixels wide (the browser's own width unless
        given), light or dark; colours: reduce it to that many palette colours (a small file for the docs)."""
        self.viewport(width or self.width, self.height, dark=dark)
        size = self.evaluate("[document.documentElement.scrollWidth, document.documentElement.scrollHeight]")
        clip = {"x": 0, "y": 0, "width": size[0], "height": size[1], "scale": 1}
        data = base64.b64decode(self.call("Page.captureScreenshot", format="png", clip=clip,
                                          captureBeyondViewport=True)["data"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        if colours is not None:
            from PIL import Image

            with Image.open(path) as image:
                image.convert("RGB").quantize(colors=colours).save(path, optimize=True)
        self.viewport(self.width, self.height)
        return path
