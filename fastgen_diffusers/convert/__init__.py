"""Convert released causal-Wan student checkpoints into causal diffusers pipeline directories.

One package, one job per module:

* :mod:`.formats`: the table of formats (Self-Forcing, CausVid, FastGen, Causal Forcing, Rolling Forcing,
  Reward Forcing, LongLive, Krea Realtime, StreamDiffusionV2): name, title, project, sampling defaults, detector.
  A new student is a row.
* :mod:`.loading`: safe file reading (``weights_only`` pickles, lazy safetensors) and format detection.
* :mod:`.mapping`: original Wan / FastGen names to diffusers names, validation, LoRA merging.
* :mod:`.writer`: streamed transformer shards, base components copied as files, the temporary output directory.
* :mod:`.card`: the model card.
* :mod:`.core`: :func:`convert_checkpoint`, which puts them together.

The command line (``fastgen-diffusers convert``) lives in :mod:`fastgen_diffusers.cli.convert`.
"""

from __future__ import annotations

import importlib
from typing import Any

# Public names load lazily (PEP 562), so that `fastgen-diffusers --help` and the convert argparse front end, which
# reads only the format table, never import torch.
_SUBMODULE_OF = {
    "model_card": "card",
    "ConversionResult": "core",
    "build_transformer": "core",
    "convert_checkpoint": "core",
    "DEFAULT_SAMPLING": "formats",
    "FORMATS": "formats",
    "STUDENT_FORMATS": "formats",
    "StudentSettings": "formats",
    "StudentFormat": "formats",
    "get_format": "formats",
    "warp_timesteps": "formats",
    "DetectedCheckpoint": "loading",
    "UnsafeCheckpointError": "loading",
    "detect_format": "loading",
    "load_checkpoint_safely": "loading",
    "CheckpointConversionError": "mapping",
    "check_state_dict": "mapping",
    "lora_key_map": "mapping",
    "merge_lora": "mapping",
    "original_to_diffusers_state_dict": "mapping",
    "to_diffusers_state_dict": "mapping",
}

__all__ = [
    "DEFAULT_SAMPLING",
    "FORMATS",
    "STUDENT_FORMATS",
    "CheckpointConversionError",
    "ConversionResult",
    "DetectedCheckpoint",
    "StudentSettings",
    "StudentFormat",
    "UnsafeCheckpointError",
    "add_convert_subparser",
    "build_transformer",
    "check_state_dict",
    "convert_checkpoint",
    "detect_format",
    "get_format",
    "load_checkpoint_safely",
    "lora_key_map",
    "merge_lora",
    "model_card",
    "original_to_diffusers_state_dict",
    "run_convert",
    "to_diffusers_state_dict",
    "warp_timesteps",
]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULE_OF:
        value = getattr(importlib.import_module(f".{_SUBMODULE_OF[name]}", __name__), name)
        globals()[name] = value
        return value
    # The argparse front end moved next to the CLI; its names stay importable from here.
    if name in ("add_convert_subparser", "run_convert"):
        from ..cli import convert as cli_convert

        return getattr(cli_convert, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
