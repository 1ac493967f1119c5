"""The quickstart notebook executes end to end on the tiny model (no GPU, no network)."""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_executes_on_the_tiny_model(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTGEN_TINY", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()

    outputs = {index: cell.get("outputs", []) for index, cell in enumerate(notebook.cells) if cell.cell_type == "code"}
    printed = "".join(out.get("text", "") for cell_outputs in outputs.values() for out in cell_outputs)
    assert "built-in tiny model (random weights)" in printed
    assert "WanCausalTransformer3DModel | chunk_size: 3" in printed
    assert "21 frames of 64x64" in printed
    assert "streamed == pipe(...): True" in printed
    assert "layout: t2v-student" in printed and "(21, 64, 64, 3)" in printed
    assert (tmp_path / "quickstart.mp4").stat().st_size > 0
    last = outputs[max(outputs)][0]
    assert last["output_type"] == "execute_result" and "<video" in last["data"]["text/html"]
