"""The README's CI-gate recipe, run literally on the simulator: the unchanged re-measurement passes the gate (exit 0),
the slowed one fails it (exit 1)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).parents[3] / "README.md"
HEADING = "## Use it as a CI gate"


def recipe(readme: Path = README) -> str:
    """The first ```bash block under the CI-gate heading."""
    section = readme.read_text().split(HEADING, 1)[1]
    match = re.search(r"```bash\n(.*?)```", section, re.S)
    assert match, f"no bash block under {HEADING!r} in {readme}"
    return match.group(1)


def test_readme_gate_recipe_passes_then_fails(tmp_path: Path) -> None:
    script = recipe()
    assert "--sim-slowdown" in script and script.count('echo "gate exit $?"') == 2
    bin_dir = Path(sys.executable).parent  # where the installed `mpfa` is
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "COLUMNS": "100"}
    env.pop("MPFA_DB", None)
    result = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, env=env,
                            timeout=240)
    exits = re.findall(r"^gate exit (\d+)$", result.stdout, re.M)
    assert exits == ["0", "1"], result.stdout[-3000:] + result.stderr[-3000:]
    assert "SIMULATED, slowed 1.2x, noise 2% (seed" in result.stdout + result.stderr
