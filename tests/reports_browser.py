"""Checks a report page in headless Chromium: nothing wider than the window, every figure drawn inside it."""

import json
import re
import shutil
import subprocess
from pathlib import Path

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Appended to a copy of a page: after layout, records what sticks out past the window (outside the scrolling table
# boxes, which are made to scroll) and where each figure was drawn.
LAYOUT_CHECK = """<script>
addEventListener("load", () => {
  const width = document.documentElement.clientWidth, overflowing = [];
  for (const el of document.body.querySelectorAll("*")) {
    if (el.parentElement && el.parentElement.closest(".scroll, svg")) continue;
    if (el.getBoundingClientRect().right > width + 1) overflowing.push(el.tagName + ": " + el.textContent.slice(0, 80));
  }
  const svgs = [...document.querySelectorAll("svg")].map(s => {
    const r = s.getBoundingClientRect();
    return {left: r.left, top: r.top + scrollY, width: r.width, height: r.height, right: r.right};
  });
  const out = document.createElement("pre");
  out.id = "layout-check";
  out.textContent = JSON.stringify({width, scrollWidth: document.documentElement.scrollWidth, overflowing, svgs});
  document.body.appendChild(out);
});
</script>"""


def _chromium(tmp_path: Path, url: str, width: int, height: int, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
         f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr", "--v=0",
         f"--window-size={width},{height}", *args, url], capture_output=True, text=True, timeout=120)


def _layout(html: Path, tmp_path: Path, width: int) -> dict:
    copy = html.with_name(f".layout-{width}-{html.name}")  # beside the page: its CSV links resolve the same
    copy.write_text(html.read_text().replace("</body>", LAYOUT_CHECK + "</body>"))
    proc = _chromium(tmp_path, copy.as_uri(), width, 2000, "--dump-dom")
    found = re.search(r'<pre id="layout-check">(.*?)</pre>', proc.stdout, flags=re.S)
    assert found, proc.stderr[-2000:]
    return json.loads(found[1].replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">"))


def check_in_chromium(html: Path, tmp_path: Path) -> None:
    """The page at 1200 and 700 pixels: nothing wider than the window, every figure drawn inside it and visibly
    non-empty in a screenshot, and no console message."""
    from PIL import Image

    svgs = html.read_text().count("<svg ")
    for width in (1200, 700):
        layout = _layout(html, tmp_path, width)
        assert layout["overflowing"] == [] and layout["scrollWidth"] <= layout["width"], (width, layout)
        assert len(layout["svgs"]) == svgs
        for box in layout["svgs"]:
            assert box["width"] > 200 and box["height"] > 100 and box["right"] <= layout["width"], (width, box)
    height = int(max([b["top"] + b["height"] for b in layout["svgs"]] + [1000])) + 100
    shot = tmp_path / f"{html.stem}.png"
    proc = _chromium(tmp_path, html.as_uri(), 700, height, f"--screenshot={shot}")
    assert shot.is_file(), proc.stderr[-2000:]
    console = [line for line in proc.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not console, console
    image = Image.open(shot).convert("L")
    for box in layout["svgs"]:  # each figure's area of the screenshot holds a drawing, not blank page
        area = image.crop((int(box["left"]), int(box["top"]), int(box["right"]), int(box["top"] + box["height"])))
        inked = sum(area.histogram()[:200]) / (area.width * area.height)
        assert inked > 0.01, (html.name, box, inked)
