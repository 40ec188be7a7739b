"""Regenerates the README's screenshots: each command runs on the simulator, against a throwaway database, in a
100-column tmux pane whose text and colours (`capture-pane -e`) Rich turns into an SVG and cairosvg into a PNG; the
figures are `mpfa plot`'s own PNGs; the report's is headless Chromium's screenshot of `mpfa report`'s page. Needs
tmux, cairosvg (`pip install cairosvg`) and Chromium (`apt-get install chromium`); `report` alone needs Chromium only.

    python3 docs/images/capture.py           # every image
    python3 docs/images/capture.py report    # the report's only
"""
from __future__ import annotations

import io
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.text import Text

IMAGES = Path(__file__).resolve().parent
COLUMNS, ROWS = 100, 80
SOCKET = "mpfa-screenshots"  # a tmux server of its own, so no one else's panes are touched
DB = "results.db"  # $MPFA_DB, relative to a scratch directory, so the pictures name no path

SCREENSHOTS = {
    "bench-smoke-simulated": "mpfa bench --scenario smoke --engine sim",
    "compare-smoke-simulated": "mpfa compare",
    "runs-smoke-simulated": "mpfa runs",
}
PLOTS = {  # run after the screenshots: serving-matrix's bench would make it the newest scenario
    "plot-smoke-simulated": ["mpfa", "plot", "--scenario", "smoke"],
    "plot-serving-matrix-simulated": ["mpfa", "plot", "--scenario", "serving-matrix"],
}
REPORT = "report-smoke-simulated"  # `mpfa report` of a smoke bench of its own, as Chromium shows it
REPORT_WINDOW = "1200,2200"  # CSS pixels: the whole page


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", "-L", SOCKET, *args], check=True, capture_output=True, text=True,
                          timeout=600).stdout


def pane_text(command: str, cwd: str) -> str:
    """What `command` leaves in a fresh pane, its prompt line first, with colours as ANSI codes."""
    shell = f"printf '$ %s\\n' {shlex.quote(command)}; {command}; tmux wait-for -S done; exec sleep 600"
    tmux("new", "-d", "-s", "shot", "-x", str(COLUMNS), "-y", str(ROWS), "-c", cwd, f"-eMPFA_DB={DB}", shell)
    try:
        tmux("wait-for", "done")
        return tmux("capture-pane", "-t", "shot", "-e", "-p", "-S", "-", "-E", "-").rstrip() + "\n"
    finally:
        tmux("kill-server")


def save_png(ansi: str, path: Path) -> None:
    import cairosvg  # here: the report's screenshot does without it

    console = Console(record=True, width=COLUMNS, file=io.StringIO(), color_system="truecolor", force_terminal=True)
    console.print(Text.from_ansi(ansi), no_wrap=True, overflow="ignore")
    # DejaVu Sans Mono, which cairo has, is 0.602 em wide: Rich places each span by that width
    svg = console.export_svg(title="mpfa", font_aspect_ratio=0.602).replace("Fira Code, monospace", "DejaVu Sans Mono")
    cairosvg.svg2png(bytestring=svg.encode(), write_to=str(path))


def capture_report() -> None:
    """A fresh smoke bench on the simulator, its `mpfa report` page, and headless Chromium's screenshot of it."""
    chromium = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)
    if chromium is None:
        sys.exit("capture.py: no Chromium found (apt-get install chromium)")
    with tempfile.TemporaryDirectory() as scratch:
        env = {**os.environ, "MPFA_DB": DB}
        for command in (["mpfa", "bench", "--scenario", "smoke", "--engine", "sim"],
                        ["mpfa", "report", "--output", "report.html"]):
            subprocess.run(command, cwd=scratch, env=env, check=True, stdout=subprocess.DEVNULL)
        # --no-sandbox: Chromium's sandbox refuses to start as root (a container); the page is our own file
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--user-data-dir={Path(scratch) / 'chromium'}", f"--window-size={REPORT_WINDOW}",
                        f"--screenshot={IMAGES / f'{REPORT}.png'}", (Path(scratch) / "report.html").as_uri()],
                       check=True, capture_output=True, timeout=120)


def main() -> None:
    if sys.argv[1:] == ["report"]:
        capture_report()
        return
    with tempfile.TemporaryDirectory() as scratch:
        for name, command in SCREENSHOTS.items():
            save_png(pane_text(command, scratch), IMAGES / f"{name}.png")
        env = {**os.environ, "MPFA_DB": DB}
        subprocess.run(["mpfa", "bench", "--scenario", "serving-matrix", "--engine", "sim"], cwd=scratch, env=env,
                       check=True, stdout=subprocess.DEVNULL)
        for name, command in PLOTS.items():
            subprocess.run([*command, "--output", str(IMAGES / f"{name}.png")], cwd=scratch, env=env, check=True)
    capture_report()


if __name__ == "__main__":
    main()
