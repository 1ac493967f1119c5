"""What a conversion wrote (a leaf type, read by the converter and the model card)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .formats import StudentSettings

__all__ = ["ConversionResult"]


@dataclass
class ConversionResult:
    """What :func:`convert_checkpoint` wrote.

    Attributes:
        output: The pipeline directory.
        format: Row of the format table (``self-forcing``, ``longlive``, ...).
        copy: Name of the converted weight copy (``generator_ema``, ``net``, ...).
        description: What format detection found.
        sampling: The sampling settings stored with the pipeline.
        pipeline_settings: Names of the settings ``pipe(...)`` reads from the stored configs today.
        pending_settings: Names stored only in ``sampling.json`` (for policies the pipeline does not have yet).
        lora: ``None``, ``"merged"`` or ``"kept"`` (a diffusers LoRA file next to the pipeline).
        shards: Transformer weight files.
    """

    output: Path
    format: str
    copy: str
    description: str
    sampling: StudentSettings
    pipeline_settings: tuple[str, ...] = ()
    pending_settings: tuple[str, ...] = ()
    lora: str | None = None
    shards: tuple[str, ...] = ()
