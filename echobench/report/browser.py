"""Open a page in real headless Chromium over the DevTools protocol: errors, dialogs, DOM, screenshot.

Used by the browser tests and by `python -m echobench.report.browser PAGE.html SHOT.png` (the committed
dashboard screenshot). Needs a `chromium` binary and the `websocket-client` package (dev extra).
Network is off: every host name resolves to nothing, so a page that needs a CDN fails here.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--host-resolver-rules=MAP * ~NOTFOUND", "--remote-debugging-port=0", "--hide-scrollbars"]


def find_chromium() -> str | None:
    for name in CHROMIUM_NAMES:
        if path := shutil.which(name):
            return path
    return None


@dataclass
class PageLog:
    console_errors: list[str] = field(default_factory=list)
    exceptions: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)


class Chromium:
    """One headless Chromium with one page, driven synchronously over its DevTools websocket."""

    def __init__(self, width: int = 1400, height: int = 1000, timeout: float = 60):
        import websocket  # websocket-client

        binary = find_chromium()
        if binary is None:
            raise RuntimeError("no chromium binary on PATH (apt-get install chromium)")
        self.timeout = timeout
        self.width = width
        self.profile = tempfile.mkdtemp(prefix="echobench-chromium-")
        self.proc = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={self.profile}",
                                      f"--window-size={width},{height}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        port = self._devtools_port()
        targets = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=timeout))
        page = next(t for t in targets if t.get("type") == "page")
        self.ws = websocket.create_connection(page["webSocketDebuggerUrl"], timeout=timeout, suppress_origin=True)
        self.next_id = 0
        self.log = PageLog()
        self.seen: list[str] = []  # event names, so a wait does not miss one read during a call
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.send(f"{domain}.enable")

    def _devtools_port(self) -> int:
        """Chromium writes the port it chose (--remote-debugging-port=0) into the profile."""
        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited ({self.proc.returncode}): {self.proc.stderr.read().decode()[-2000:]}")
            if port_file.exists() and (text := port_file.read_text().split()):
                return int(text[0])
            time.sleep(0.1)
        raise TimeoutError("chromium did not open its DevTools port")

    def _event(self, msg: dict) -> None:
        method, params = msg.get("method"), msg.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            self.log.console_errors.append(" ".join(str(a.get("value", a.get("description", ""))) for a in params["args"]))
        elif method == "Runtime.exceptionThrown":
            details = params["exceptionDetails"]
            self.log.exceptions.append((details.get("exception") or {}).get("description") or details.get("text", ""))
        elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
            self.log.console_errors.append(params["entry"].get("text", ""))
        elif method == "Page.javascriptDialogOpening":
            self.log.dialogs.append(f"{params.get('type')}: {params.get('message')}")
            self.send("Page.handleJavaScriptDialog", accept=True, wait=False)
        elif method == "Network.requestWillBeSent":
            self.log.requests.append(params["request"]["url"])

    def _read(self) -> dict:
        msg = json.loads(self.ws.recv())
        if "method" in msg:
            self.seen.append(msg["method"])
            self._event(msg)
        return msg

    def send(self, method: str, wait: bool = True, **params) -> dict:
        self.next_id += 1
        call_id = self.next_id
        self.ws.send(json.dumps({"id": call_id, "method": method, "params": params}))
        while wait:
            msg = self._read()
            if msg.get("id") == call_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
        return {}

    def wait_for(self, method: str) -> None:
        deadline = time.monotonic() + self.timeout
        while method not in self.seen and time.monotonic() < deadline:
            self._read()
        if method in self.seen:
            return
        raise TimeoutError(f"no {method} within {self.timeout} s")

    def open(self, path: Path) -> None:
        self.seen.clear()
        self.send("Page.navigate", url=Path(path).resolve().as_uri())
        self.wait_for("Page.loadEventFired")

    def evaluate(self, expression: str):
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path, full_page: bool = True, selector: str | None = None) -> Path:
        """A PNG of the page (all of it with full_page), or of the first element matching selector."""
        # plotly's toolbars show in a headless capture as if hovered; they say nothing in a picture
        self.evaluate("document.head.insertAdjacentHTML('beforeend', '<style>.modebar{display:none}</style>')")
        if full_page:
            size = self.send("Page.getLayoutMetrics")["cssContentSize"]
            self.send("Emulation.setDeviceMetricsOverride", width=self.width, height=int(size["height"]),
                      deviceScaleFactor=1, mobile=False)
            self.evaluate("new Promise(r => requestAnimationFrame(() => setTimeout(r, 300)))")
        clip = {}
        if selector is not None:
            box = self.evaluate(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); if (!e) return null;"
                                " const r = e.getBoundingClientRect();"
                                " return {x: r.left + scrollX, y: r.top + scrollY, width: r.width, height: r.height}; })()")
            if box is None:
                raise RuntimeError(f"no element matches {selector!r}")
            clip = {"clip": {**box, "scale": 1}}
        data = self.send("Page.captureScreenshot", format="png", captureBeyondViewport=full_page, **clip)["data"]
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        try:
            self.ws.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print("usage: python -m echobench.report.browser PAGE.html SHOT.png [CSS_SELECTOR]", file=sys.stderr)
        return 2
    with Chromium() as browser:
        browser.open(Path(argv[0]))
        shot = browser.screenshot(Path(argv[1]), selector=argv[2] if len(argv) == 3 else None)
        problems = browser.log.console_errors + browser.log.exceptions + browser.log.dialogs
    print(f"wrote {shot} ({os.path.getsize(shot)} bytes)" + (f"; page problems: {problems}" if problems else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
