"""The README is a user guide that stays true: short, its links resolve, its test command is the one CI runs, and its
way back to diffusers' ``WanPipeline`` runs as printed."""

from __future__ import annotations

import re
from pathlib import Path

import torch
from diffusers import WanPipeline

from fastgen_diffusers import WanCausalPipeline, WanCausalTransformer3DModel
from fastgen_diffusers.testing import tiny_pipeline

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MAX_LINES = 250


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_the_readme_is_a_short_guide():
    assert len(README.splitlines()) <= MAX_LINES
    for section in ("## Install", "## 1. Convert a research checkpoint", "## 2. Generate", "## 5. Serve"):
        assert section in README
    assert "What is verified, and how" in README and "No released checkpoint has been run here" in README


def test_relative_links_of_the_readme_and_docs_resolve():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            assert resolved.exists(), f"{page.name}: link {target!r} points nowhere"
            if anchor:
                headings = re.findall(r"^#+ (.+)$", resolved.read_text(), flags=re.M)
                assert anchor in {_slug(h) for h in headings}, f"{page.name}: no heading for {target!r}"


def test_the_readme_test_command_is_the_one_ci_runs():
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if "pytest" in line]
    commands = set(re.findall(r"^python -m pytest .*$", README, flags=re.M))
    # the whole suite first, exactly as the README prints it; then only re-runs of single test files (the
    # quantization tests, skipped in the first run without torchao, once the `quantization` extra is installed)
    assert ci[0] == "python -m pytest -q -p no:cacheprovider tests"
    assert commands == {ci[0]}
    for line in ci[1:]:
        target = line.removeprefix("python -m pytest -q -p no:cacheprovider ")
        assert re.fullmatch(r"tests/test_\w+\.py", target) and (ROOT / target).exists(), line
        assert target in README, f"the README does not say that CI re-runs {target}"


def test_the_way_back_to_wan_pipeline_runs_as_printed():
    code = next(block for block in _python_blocks(README) if "wan_transformer_from_causal" in block)
    pipe = tiny_pipeline()
    namespace = {"pipe": pipe}
    exec(code, namespace)
    wan, causal = namespace["wan"], namespace["causal"]
    assert type(wan) is WanPipeline and type(wan.transformer).__name__ == "WanTransformer3DModel"
    assert type(causal) is WanCausalPipeline and type(causal.transformer) is WanCausalTransformer3DModel
    shared = pipe.transformer.proj_out.weight
    assert (
        wan.transformer.proj_out.weight.data_ptr()
        == causal.transformer.proj_out.weight.data_ptr()
        == (shared.data_ptr())
    )
    assert torch.equal(causal.transformer.proj_out.weight, shared)
