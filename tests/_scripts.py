"""Load a file of ``scripts/`` (not a package) as a module, once per process."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(filename: str) -> ModuleType:
    name = "kvo_scripts_" + Path(filename).stem
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / filename)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the file executes
        spec.loader.exec_module(module)
    return sys.modules[name]
