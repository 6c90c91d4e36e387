"""Load a script of examples/ as a module (its own name, so that tests do not share state)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(script: str, name: str) -> ModuleType:
    """``examples/<script>`` executed as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
