"""The quickstart notebook executes end to end, offline and without a GPU: on the built-in tiny model, and on its
real-model path with a tiny chunk-3 student saved to a directory (the layout `fastgen-diffusers convert` writes)."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

from fastgen_diffusers.testing import tiny_pipeline

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def execute_notebook(tmp_path: Path, monkeypatch, **env: str) -> tuple[dict[int, list], str]:
    """Run the notebook in ``tmp_path`` with ``env`` set; its code cells' outputs and all printed text."""
    for name, value in {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **env}.items():
        monkeypatch.setenv(name, value)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = {index: cell.get("outputs", []) for index, cell in enumerate(notebook.cells) if cell.cell_type == "code"}
    printed = "".join(out.get("text", "") for cell_outputs in outputs.values() for out in cell_outputs)
    return outputs, printed


def test_quickstart_notebook_executes_on_the_tiny_model(tmp_path, monkeypatch):
    outputs, printed = execute_notebook(tmp_path, monkeypatch, FASTGEN_TINY="1")
    assert "built-in tiny model (random weights)" in printed
    assert "WanCausalTransformer3DModel | chunk_size: 3" in printed
    assert "21 frames of 64x64" in printed
    assert "streamed == pipe(...): True" in printed
    assert "layout: t2v-student" in printed and "(21, 64, 64, 3)" in printed
    assert "restyled chunk 1: 12 frames from frame 9" in printed and "restyled: (21, 64, 64, 3)" in printed
    assert "recompute + bias: (21, 64, 64, 3)" in printed
    assert (tmp_path / "quickstart.mp4").stat().st_size > 0
    last = outputs[max(outputs)][0]
    assert last["output_type"] == "execute_result" and "<video" in last["data"]["text/html"]


def test_quickstart_real_model_path_with_a_chunk_3_student(tmp_path, monkeypatch):
    """The cells a user with a real student runs (`from_pretrained` of a directory, image-to-video with what a
    chunk-3 student without `independent_first_frame` supports: extending a one-chunk clip), on a tiny twin."""
    student = tmp_path / "student"
    tiny_pipeline(seed=1).save_pretrained(student)  # chunk_size 3, independent_first_frame False
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {"FASTGEN_TINY": "0", "FASTGEN_MODEL": str(student), "FASTGEN_VIDEO": "32x32x21"}
    outputs, printed = execute_notebook(run_dir, monkeypatch, **env)
    assert f"model: {student} | device:" in printed and "RANDOM" not in printed
    assert "WanCausalTransformer3DModel | chunk_size: 3" in printed
    assert "21 frames of 32x32" in printed
    assert "streamed == pipe(...): True" in printed
    assert "extending a 9-frame clip (3 latent frames, one chunk)" in printed
    assert "layout: t2v-student" in printed and "(21, 32, 32, 3)" in printed
    assert "restyled: (21, 32, 32, 3)" in printed and "recompute + bias: (21, 32, 32, 3)" in printed
    assert (run_dir / "quickstart.mp4").stat().st_size > 0
