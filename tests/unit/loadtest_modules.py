"""Import a script of ``loadtests/`` (not a package) as a module, for testing its pure parts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

LOADTESTS = Path(__file__).resolve().parents[2] / "loadtests"


def load_loadtest(name: str) -> ModuleType:
    """``loadtests/<name>.py`` as module ``name`` (registered in ``sys.modules``: dataclasses
    resolve their module by name)."""
    spec = importlib.util.spec_from_file_location(name, LOADTESTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
