"""Headless Chromium driven through the DevTools protocol over a pipe (no library, no
network): load a page, run script in it, move the mouse, type, take screenshots, and
collect every console message and uncaught exception."""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

CHROMIUM = shutil.which("chromium")


class Browser:
    """One headless Chromium with one page, `width` x `height` CSS pixels."""

    def __init__(self, width: int = 1280, height: int = 900) -> None:
        assert CHROMIUM, "chromium missing: run scripts/setup"
        self.profile = tempfile.mkdtemp(prefix="memtrack-chromium-")
        # the protocol pipe is the browser's fds 3 (commands in) and 4 (replies out)
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()
        null = os.open(os.devnull, os.O_RDWR)
        self.pid = os.posix_spawn(CHROMIUM, [
            CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
            "--remote-debugging-pipe", f"--user-data-dir={self.profile}", "--hide-scrollbars",
            "--disable-background-networking", "--disable-extensions", "about:blank"],
            os.environ, file_actions=[
                (os.POSIX_SPAWN_DUP2, null, 0), (os.POSIX_SPAWN_DUP2, null, 1),
                (os.POSIX_SPAWN_DUP2, null, 2), (os.POSIX_SPAWN_DUP2, to_chrome_r, 3),
                (os.POSIX_SPAWN_DUP2, from_chrome_w, 4)])
        for fd in (to_chrome_r, from_chrome_w, null):
            os.close(fd)
        self._buf = b""
        self._id = 0
        self.console: list[str] = []  # console messages and uncaught exceptions
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target,
                                 flatten=True)["sessionId"]
        for domain in ("Page", "Runtime"):
            self.call(f"{domain}.enable", session=True)
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=width,
                  height=height, deviceScaleFactor=1, mobile=False)

    def _send(self, msg: dict[str, Any]) -> None:
        os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")

    def _receive(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_chrome], [], [], left)[0]:
                raise TimeoutError("chromium did not answer")
            chunk = os.read(self._from_chrome, 1 << 20)
            if not chunk:
                raise RuntimeError("chromium exited")
            self._buf += chunk
        raw, _, self._buf = self._buf.partition(b"\0")
        msg = json.loads(raw)
        method = msg.get("method")
        if method == "Runtime.consoleAPICalled":
            args = msg["params"]["args"]
            self.console.append(" ".join(str(a.get("value", a.get("description"))) for a in args))
        elif method == "Runtime.exceptionThrown":
            self.console.append(msg["params"]["exceptionDetails"].get("text", "exception"))
        return msg

    def call(self, method: str, *, session: bool = False, timeout: float = 60,
             **params: Any) -> dict[str, Any]:
        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        self._send(msg)
        while True:
            reply = self._receive(timeout)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def open(self, url: str, ready: str = "document.body.dataset.status !== 'loading'") -> None:
        """Load `url` afresh (another fragment alone would not reload a page) and wait
        until the expression `ready` holds."""
        self.call("Page.navigate", session=True, url="about:blank")
        self.call("Page.navigate", session=True, url=url)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.eval(f"document.readyState === 'complete' && ({ready})"):
                return
            if self.console:  # a script that failed never gets ready
                raise RuntimeError(f"{url}: {self.console}")
            time.sleep(0.05)
        raise TimeoutError(f"{url}: not ready")

    def eval(self, expression: str) -> Any:
        """The value of a script expression in the page (JSON-able)."""
        r = self.call("Runtime.evaluate", session=True, expression=expression,
                      returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def mouse(self, x: float, y: float, kind: str = "mouseMoved") -> None:
        """Move the mouse to (x, y) ("mouseMoved"), or click there ("click")."""
        if kind == "click":
            for t in ("mousePressed", "mouseReleased"):
                self.call("Input.dispatchMouseEvent", session=True, type=t, x=x, y=y,
                          button="left", clickCount=1)
        else:
            self.call("Input.dispatchMouseEvent", session=True, type=kind, x=x, y=y)

    def point(self, selector: str, fx: float = 0.5, fy: float = 0.5) -> tuple[float, float]:
        """Scroll the first element matching `selector` to the middle of the window;
        the window point at fractions (fx, fy) of its box."""
        box = self.eval(f"""(() => {{
            const e = document.querySelector({json.dumps(selector)});
            e.scrollIntoView({{block: "center", inline: "center"}});
            const r = e.getBoundingClientRect();
            return [r.left, r.top, r.width, r.height]; }})()""")
        return box[0] + box[2] * fx, box[1] + box[3] * fy

    def type(self, text: str) -> None:
        self.call("Input.insertText", session=True, text=text)

    def screenshot(self, path: Path, selector: str | None = None) -> Path:
        """The whole page (not only the window), or the box of the first element
        matching `selector`, as PNG."""
        if selector is None:
            box = self.eval("[0, 0, document.documentElement.scrollWidth, "
                            "document.documentElement.scrollHeight]")
        else:
            # a sticky header stays where it is in the page while the element is taken
            box = self.eval(f"""(() => {{
                const e = document.querySelector({json.dumps(selector)});
                document.querySelectorAll("header").forEach(h => h.style.position = "static");
                const r = e.getBoundingClientRect();
                return [Math.max(r.left + scrollX - 8, 0), r.top + scrollY, r.width + 16,
                        r.height]; }})()""")
        data = self.call("Page.captureScreenshot", session=True, format="png",
                         captureBeyondViewport=True,
                         clip={"x": box[0], "y": box[1], "width": box[2], "height": box[3],
                               "scale": 1})["data"]
        self.eval('document.querySelectorAll("header").forEach(h => h.style.position = "")')
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=10)
        except (RuntimeError, TimeoutError, OSError):
            pass
        deadline = time.monotonic() + 10
        while os.waitpid(self.pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                break
            time.sleep(0.05)
        os.close(self._to_chrome)
        os.close(self._from_chrome)
        shutil.rmtree(self.profile, ignore_errors=True)


SCREENS = Path("/tmp/memtrack-screens")  # a stable place to look at them after a run


def screens_dir() -> Path:
    """Where the HTML tests save their screenshots: $MEMTRACK_SCREENS, else SCREENS."""
    return Path(os.environ.get("MEMTRACK_SCREENS") or SCREENS)
