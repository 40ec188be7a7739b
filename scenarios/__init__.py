"""Named benchmark scenarios (TOML) and the model configs used for dummy-weight serving."""
from importlib.resources import files
from pathlib import Path

SCENARIO_DIR = Path(str(files(__name__)))
MODEL_DIR = SCENARIO_DIR / "models"
