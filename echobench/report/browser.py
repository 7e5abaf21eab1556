"""Open a page in real headless Chromium through playwright: errors, dialogs, DOM, screenshot.

Used by the browser tests and by `python -m echobench.report.browser [--width PX] [--height PX --top] PAGE.html SHOT.png [SELECTOR]`
(the committed dashboard screenshots, of the page or of one element, after the same layout check the
tests make). Needs a `chromium` binary (Debian's: playwright drives it by its path, so no
`playwright install`) and the `playwright` package (dev extra).
Network is off: every host name resolves to nothing, so a page that needs a CDN fails here.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")
# on top of playwright's own (headless, --no-sandbox as CI runs as root, --hide-scrollbars, no background networking)
FLAGS = ["--disable-gpu", "--disable-quic", "--disable-sync", "--host-resolver-rules=MAP * ~NOTFOUND"]
# plotly's toolbars show in a headless capture as if hovered; they say nothing in a picture
SCREENSHOT_STYLE = ".modebar{display:none}"
SETTLE_JS = "new Promise(r => requestAnimationFrame(() => setTimeout(r, 300)))"


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
    """One headless Chromium with one page, driven by playwright's synchronous API."""

    def __init__(self, width: int = 1400, height: int = 1000, timeout: float = 60):
        try:
            from playwright.sync_api import Error, sync_playwright  # the dev extra, not a run dependency
        except ImportError as exc:
            raise RuntimeError("the browser check needs playwright: pip install playwright") from exc
        binary = find_chromium()
        if binary is None:
            raise RuntimeError("no chromium binary on PATH (apt-get install chromium)")
        self._script_error = Error
        self.width, self.height = width, height
        self.log = PageLog()
        self.playwright = sync_playwright().start()
        try:
            self.browser = self.playwright.chromium.launch(executable_path=binary, headless=True, args=FLAGS,
                                                           timeout=timeout * 1000)
            self.page = self.browser.new_page(viewport={"width": width, "height": height})
        except BaseException:
            self.playwright.stop()
            raise
        self.page.set_default_timeout(timeout * 1000)
        self.page.on("console", self._console)
        self.page.on("pageerror", lambda error: self.log.exceptions.append(error.stack or error.message))
        self.page.on("dialog", self._dialog)
        self.page.on("request", lambda request: self.log.requests.append(request.url))

    def _console(self, msg) -> None:
        if msg.type in ("error", "assert"):  # console.error/assert, and Chromium's own errors (a failed load)
            self.log.console_errors.append(msg.text)

    def _dialog(self, dialog) -> None:
        self.log.dialogs.append(f"{dialog.type}: {dialog.message}")
        dialog.accept()

    def open(self, path: Path) -> None:
        self.page.goto(Path(path).resolve().as_uri(), wait_until="load")

    def evaluate(self, expression: str):
        try:
            return self.page.evaluate(expression)
        except self._script_error as exc:
            raise RuntimeError(f"page script failed: {exc.message}") from exc

    def fit_to_page(self) -> None:
        """Make the viewport as tall as the page (and let plotly redraw), so all of it is in view."""
        height = self.evaluate("document.documentElement.scrollHeight")
        self.page.set_viewport_size({"width": self.width, "height": int(height)})
        self.evaluate(SETTLE_JS)

    def reset_viewport(self) -> None:
        self.page.set_viewport_size({"width": self.width, "height": self.height})

    def screenshot(self, path: Path, full_page: bool = True, selector: str | None = None) -> Path:
        """A PNG of the page (all of it with full_page), or of the first element matching selector."""
        if full_page:
            self.fit_to_page()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if selector is None:
            self.page.screenshot(path=path, full_page=full_page, style=SCREENSHOT_STYLE)
        else:
            element = self.page.locator(selector)
            if element.count() == 0:
                raise RuntimeError(f"no element matches {selector!r}")
            element.first.screenshot(path=path, style=SCREENSHOT_STYLE)
        return path

    def close(self) -> None:
        try:
            self.browser.close()
        finally:
            self.playwright.stop()

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
    browser.fit_to_page()
    try:
        result = browser.evaluate(LAYOUT_JS)
    finally:
        browser.reset_viewport()
    return result["checked"], result["problems"]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m echobench.report.browser",
                                     description="Screenshot a page in headless Chromium; check its plots' layout.")
    parser.add_argument("page", type=Path)
    parser.add_argument("shot", type=Path)
    parser.add_argument("selector", nargs="?", default=None, help="CSS selector of the element to capture (default: the page)")
    parser.add_argument("--width", type=int, default=1400, help="window width in CSS pixels")
    parser.add_argument("--height", type=int, default=1000, help="window height in CSS pixels")
    parser.add_argument("--top", action="store_true", help="capture only the window's first screen, as a reader "
                                                           "first sees the page (default: the whole page)")
    args = parser.parse_args(argv)
    with Chromium(width=args.width, height=args.height) as browser:
        browser.open(args.page)
        checked, layout = layout_problems(browser)
        shot = browser.screenshot(args.shot, full_page=not args.top, selector=args.selector)
        problems = browser.log.console_errors + browser.log.exceptions + browser.log.dialogs + layout
    print(f"wrote {shot} ({os.path.getsize(shot)} bytes, {args.width} px wide{' x ' + str(args.height) if args.top else ''}; "
          f"{checked} plots checked)"
          + (f"; page problems: {problems}" if problems else ""))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
