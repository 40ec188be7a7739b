"""The plugin package imports without SGLang or torch, its entry point is declared for SGLang's plugin group and
resolves to a callable, and calling it without SGLang fails with one clear line."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
GROUP = "sglang.srt.plugins"  # sglang.srt.plugins.GENERAL_PLUGINS_GROUP in SGLang 0.5.15


def test_import_is_light_and_side_effect_free():
    code = ("import sys; import mpfa.backends.sglang_plugin as p; "
            "heavy = [m for m in sys.modules if m.split('.')[0] in ('sglang', 'torch', 'triton', 'cutlass')]; "
            "print(p.BACKEND_NAMES, heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "('mpfa', 'mpfa-direct') []"


def test_entry_point_declared_and_callable():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    target = project["entry-points"][GROUP]["mpfa"]
    module, _, attr = target.partition(":")
    assert callable(getattr(importlib.import_module(module), attr))


def test_backend_specs_name_this_plugin():
    from mpfa.backends.specs import BACKENDS
    from mpfa.backends.sglang_plugin import BACKEND_NAMES

    for name in BACKEND_NAMES:
        spec = BACKENDS[name]
        assert spec.plugin == "mpfa.backends.sglang_plugin"
        assert spec.sglang_args[:2] == ("--attention-backend", name)


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here")
def test_register_without_sglang_is_one_clear_line():
    from mpfa.backends.sglang_plugin import register
    from mpfa.backends.sglang_plugin.setup_checks import MpfaSetupError

    with pytest.raises(MpfaSetupError, match=r"SGLang is not installed.*\[serve\]") as info:
        register()
    assert "\n" not in str(info.value)
