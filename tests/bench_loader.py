"""Load a script of ``benchmarks/`` as a module, as ``python benchmarks/<name>.py`` would see its folder (the scripts
share ``benchmarks/_common.py``): the tiny-mode smoke tests call its ``main(argv)``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a fresh module (``benchmarks/`` put on ``sys.path`` once)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
