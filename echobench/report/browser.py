"""Open a page in real headless Chromium over the DevTools protocol: errors, dialogs, DOM, screenshot.

Used by the browser tests and by `python -m echobench.report.browser [--width PX] PAGE.html SHOT.png [SELECTOR]`
(the committed dashboard screenshots, of the page or of one element, after the same layout check the
tests make). Needs a `chromium` binary and the `websocket-client` package (dev extra).
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
        try:
            import websocket  # websocket-client: the dev extra, not a run dependency
        except ImportError as exc:
            raise RuntimeError("the browser check needs websocket-client: pip install websocket-client") from exc
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


# Every shown plotly figure, as drawn: does its SVG stay inside its panel and section, does its
# legend stay off the plot areas, is every trace drawn inside its own subplot's axes, and can one
# of its markers be seen (not all under other traces' markers: the topmost data shape at the
# marker's centre or at a point around it is its own)? Traces map to their
# <g class="trace"> through the calcdata plotly binds to it (d3's __data__).
LAYOUT_JS = r"""(() => {
  const problems = [], inside = (r, a, tol) => r.left >= a.left - tol && r.right <= a.right + tol
      && r.top >= a.top - tol && r.bottom <= a.bottom + tol;
  const overlap = (a, b) => Math.min(a.right, b.right) - Math.max(a.left, b.left) > 1
      && Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top) > 1;
  const SHAPES = 'path.point, path.js-line, g.point > path';
  // where a marker is probed, in marker sizes from its centre (out to the outline of open symbols)
  const OFFSETS = [[0, 0]].concat(...[0.2, 0.35, 0.45].map(d => [[-d, 0], [d, 0], [0, -d], [0, d]]));
  // plotly leaves its shapes out of hit-testing (its drag layer takes the pointer): put them back
  const hit = document.createElement('style');
  hit.textContent = '.js-plotly-plot g.trace path { pointer-events: visiblePainted !important; }';
  document.head.appendChild(hit);
  let checked = 0;
  for (const el of document.querySelectorAll('.js-plotly-plot')) {
    if (el.offsetParent === null) continue;  // hidden by a filter
    checked += 1;
    const svg = el.querySelector('.main-svg').getBoundingClientRect();
    for (const box of [el.closest('.panel'), el.closest('section')]) {
      if (box && !inside(svg, box.getBoundingClientRect(), 1))
        problems.push(`${el.id}: the plot (${Math.round(svg.width)} px) overflows its ${box.tagName === 'SECTION' ? 'section' : 'panel'} (${Math.round(box.getBoundingClientRect().width)} px)`);
    }
    const areas = {};  // subplot ("xy", "xy2") -> its plot area
    el.querySelectorAll('.nsewdrag').forEach(d => { areas[d.getAttribute('data-subplot')] = d.getBoundingClientRect(); });
    const legend = el.querySelector('.legend');
    if (legend && Object.values(areas).some(a => overlap(legend.getBoundingClientRect(), a)))
      problems.push(`${el.id}: the legend covers the plot area`);
    const data = new Set(el.querySelectorAll('g.trace ' + SHAPES.split(', ').join(', g.trace ')));
    const topmost = (x, y) => document.elementsFromPoint(x, y).find(e => data.has(e));
    const drawn = {};
    for (const g of el.querySelectorAll('g.trace')) {
      const cd = g.__data__, trace = cd && cd[0] && cd[0].trace;
      if (!trace) continue;
      const area = areas[(trace.xaxis || 'x') + (trace.yaxis || 'y')];
      const shapes = Array.from(g.querySelectorAll(SHAPES)).filter(p => {
        const r = p.getBoundingClientRect(); return r.width > 0 || r.height > 0; });
      const centres = shapes.map(p => { const r = p.getBoundingClientRect();
        return {left: r.left + r.width / 2, right: r.left + r.width / 2, top: r.top + r.height / 2,
                bottom: r.top + r.height / 2, w: r.width, h: r.height, marker: p.matches('path.point')}; });
      const shown = area ? centres.filter(c => inside(c, area, 2)).length : 0;
      drawn[trace.index] = (drawn[trace.index] || 0) + centres.length;
      if (shown < centres.length)
        problems.push(`${el.id}: trace '${trace.name}' has ${centres.length - shown} of ${centres.length} shapes outside the plot area`);
      const markers = centres.filter(c => c.marker && g.classList.contains('scatter'));
      const seen = markers.some(c => OFFSETS.some(([dx, dy]) => {
        const top = topmost(c.left + dx * c.w, c.top + dy * c.h); return top && top.closest('g.trace') === g; }));
      if (markers.length && !seen)
        problems.push(`${el.id}: every marker of trace '${trace.name}' is hidden under other traces`);
    }
    (el._fullData || []).forEach(t => {
      if (t.visible === true && !drawn[t.index])
        problems.push(`${el.id}: trace '${t.name}' is not drawn`);
    });
  }
  hit.remove();
  return {checked: checked, problems: problems};
})()"""


def layout_problems(browser: "Chromium") -> tuple[int, list[str]]:
    """(plots checked, problems) of the open page's visible plotly figures: a plot wider than its
    panel or section, a legend over a plot area, a trace not drawn, drawn outside its axes or with
    every marker under other traces. The viewport is made as tall as the page for the check, so
    every plot can be hit-tested (elementsFromPoint sees only the viewport)."""
    height = browser.evaluate("document.documentElement.scrollHeight")
    browser.send("Emulation.setDeviceMetricsOverride", width=browser.width, height=int(height), deviceScaleFactor=1,
                 mobile=False)
    browser.evaluate("new Promise(r => requestAnimationFrame(() => setTimeout(r, 300)))")
    try:
        result = browser.evaluate(LAYOUT_JS)
    finally:
        browser.send("Emulation.clearDeviceMetricsOverride")
    return result["checked"], result["problems"]


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m echobench.report.browser",
                                     description="Screenshot a page in headless Chromium; check its plots' layout.")
    parser.add_argument("page", type=Path)
    parser.add_argument("shot", type=Path)
    parser.add_argument("selector", nargs="?", default=None, help="CSS selector of the element to capture (default: the page)")
    parser.add_argument("--width", type=int, default=1400, help="window width in CSS pixels")
    args = parser.parse_args(argv)
    with Chromium(width=args.width) as browser:
        browser.open(args.page)
        checked, layout = layout_problems(browser)
        shot = browser.screenshot(args.shot, selector=args.selector)
        problems = browser.log.console_errors + browser.log.exceptions + browser.log.dialogs + layout
    print(f"wrote {shot} ({os.path.getsize(shot)} bytes, {args.width} px wide; {checked} plots checked)"
          + (f"; page problems: {problems}" if problems else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
