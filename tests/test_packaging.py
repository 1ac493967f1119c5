"""Packaging metadata: the license is declared and shipped, extras hold what the features need, the diffusers pin
admits the installed release."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_license_is_an_spdx_expression_with_its_file():
    project = PROJECT["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    assert Requirement(PROJECT["build-system"]["requires"][0]).specifier.contains("77")  # PEP 639 support
    assert project["classifiers"] and project["urls"]


def test_extras_hold_what_their_features_need():
    extras = {
        name: [Requirement(r).name for r in reqs] for name, reqs in PROJECT["project"]["optional-dependencies"].items()
    }
    assert "peft" in extras["lora"]  # `load_lora_weights`
    assert "ruff" not in extras["test"] and "ruff" in extras["dev"]
    assert {"fastapi", "uvicorn"} <= set(extras["serve"])  # `fastgen-diffusers serve`
    assert "torchao" in extras["quantization"]  # diffusers' TorchAoConfig
    assert "torchao" not in extras["test"]  # imported by every diffusers import once installed (about 5 s)
    assert {"websockets", "playwright", "fastapi", "uvicorn"} <= set(extras["test"])  # tests/test_serve*.py


def test_the_diffusers_pin_admits_the_installed_release():
    import diffusers

    pin = next(Requirement(r) for r in PROJECT["project"]["dependencies"] if r.startswith("diffusers"))
    assert pin.specifier.contains(Version(diffusers.__version__))
