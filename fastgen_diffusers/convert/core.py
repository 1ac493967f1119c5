"""``convert_checkpoint``: a released causal-Wan student file -> a ``WanCausalPipeline`` directory."""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from accelerate import init_empty_weights
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.utils import logging

from ..hub import make_hub_loadable
from ..models import WanCausalTransformer3DModel
from ..settings import ArgumentTypeError
from .card import model_card
from .formats import StudentSettings, get_format
from .loading import LazySafetensors, detect_format, load_checkpoint_safely, load_lora_state_dict
from .mapping import CheckpointConversionError, check_state_dict, diffusers_key_map, lora_key_map, merge_lora
from .result import ConversionResult
from .writer import (
    SAFETENSORS_DTYPES,
    atomic_output_dir,
    base_component_entries,
    copy_base_components,
    parse_size,
    resolve_base,
    write_sharded_safetensors,
)

__all__ = ["ConversionResult", "build_transformer", "convert_checkpoint"]

logger = logging.get_logger(__name__)  # pylint: disable=invalid-name

LORA_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
SAMPLING_FILE = "sampling.json"
# Settings that live in the transformer / scheduler configs rather than in model_index.json.
_MODEL_SETTINGS = ("chunk_size", "independent_first_frame", "shift")
# The dtypes `dtype` accepts: those a safetensors shard holds (float8 as F8_E4M3 / F8_E5M2).
DTYPE_NAMES = tuple(str(dtype).removeprefix("torch.") for dtype in SAFETENSORS_DTYPES.values())


def _parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None:
        return None
    parsed = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype).removeprefix("torch."), None)
    if parsed not in SAFETENSORS_DTYPES.values():
        raise ValueError(f"`dtype` must be one of {DTYPE_NAMES} (what safetensors shards hold), got {dtype!r}.")
    return parsed


def _source_shape_dtype(weights: Mapping, key: str) -> tuple[tuple[int, ...], torch.dtype | str]:
    if isinstance(weights, LazySafetensors):
        code = weights.dtype(key)
        return weights.shape(key), SAFETENSORS_DTYPES.get(code, code)
    tensor = weights[key]
    return tuple(tensor.shape), tensor.dtype


def _non_finite(tensor: torch.Tensor) -> int:
    """How many NaN/Inf values ``tensor`` holds (float8 is counted in float32: torch has no ``isfinite`` for it)."""
    if tensor.dtype.itemsize == 1:
        tensor = tensor.float()
    return int((~torch.isfinite(tensor)).sum())


def _causal_config(base: str | os.PathLike, chunk_size: int | None, independent_first_frame: bool | None) -> dict:
    config = dict(WanCausalTransformer3DModel.load_config(base, subfolder="transformer"))
    if chunk_size is not None:
        config["chunk_size"] = chunk_size
    if independent_first_frame is not None:
        config["independent_first_frame"] = independent_first_frame
    return config


def build_transformer(
    state_dict: Mapping[str, torch.Tensor],
    base: str | os.PathLike,
    *,
    chunk_size: int | None = None,
    independent_first_frame: bool | None = None,
    dtype: torch.dtype | None = None,
) -> WanCausalTransformer3DModel:
    """A [`WanCausalTransformer3DModel`] with ``base``'s transformer config holding ``state_dict`` (diffusers names).

    The model is built on the meta device and takes the checkpoint tensors as its parameters (no random init, no
    copy unless ``dtype`` casts them). :func:`convert_checkpoint` streams instead and never builds the model.

    Raises:
        CheckpointConversionError: unexpected or missing keys, or shapes that do not fit the base config.
    """
    with init_empty_weights():
        transformer = WanCausalTransformer3DModel.from_config(
            _causal_config(base, chunk_size, independent_first_frame)
        )
    check_state_dict(state_dict, {key: value.shape for key, value in transformer.state_dict().items()})
    tensors = {}
    for key, value in state_dict.items():
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        tensors[key] = value.contiguous()
    transformer.load_state_dict(tensors, strict=True, assign=True)
    return transformer.eval()


def _pipeline_config_keys() -> set[str]:
    from ..pipelines import WanCausalPipeline

    return set(inspect.signature(WanCausalPipeline.__init__).parameters) - {"self"}


def convert_checkpoint(
    checkpoint: str | os.PathLike,
    *,
    base: str | os.PathLike,
    output: str | os.PathLike,
    format: str = "auto",
    ema: bool | str | None = None,
    dtype: torch.dtype | str | None = None,
    base_model_id: str | None = None,
    lora: str | os.PathLike | None = None,
    lora_alpha: float | None = None,
    keep_lora: bool = False,
    allow_non_finite: bool = False,
    max_shard_size: int | str = "5GB",
    **settings: Any,
) -> ConversionResult:
    """Convert a released causal-Wan student checkpoint into a [`WanCausalPipeline`] directory.

    Args:
        checkpoint: The ``.pt`` / ``.pth`` / ``.safetensors`` file.
        base: Diffusers Wan directory or Hub id: text encoder, tokenizer, VAE, scheduler and transformer config.
        output: Directory to write (must not exist or be empty); written beside it first and renamed at the end.
        format: ``"auto"`` or a row of the format table (``FORMATS``); picks the stored sampling settings.
        ema: ``None`` (what the project's loader takes), ``True``, ``False`` or the name of a weight copy.
        dtype: Cast the transformer weights (``"bfloat16"``, ``torch.float16``, ``"float8_e4m3fn"``, ...; see
            ``DTYPE_NAMES``); default: keep the checkpoint's.
        **settings: Override the format's stored settings, each by the name of a [`StudentSettings`] field
            (``chunk_size``, ``timesteps``, ``shift``, ``attention_window``, ``kv_cache_policy``, ...;
            ``None`` keeps the format's).
        base_model_id: Hub id written as ``base_model`` in the model card; default: ``base`` when it is a Hub id (or a
            Hub cache snapshot). A local ``base`` without one gets a card without ``base_model``, with a warning.
        lora: A PEFT LoRA file (LongLive's ``lora.pt``) to merge, ``W + alpha / r * B @ A`` in float32.
        lora_alpha: LoRA alpha (default: the format's, e.g. 256 for LongLive, else the rank).
        keep_lora: Write the LoRA as ``pytorch_lora_weights.safetensors`` (diffusers naming) next to the pipeline for
            ``pipe.load_lora_weights(dir)`` instead of merging it.
        allow_non_finite: Convert weights holding NaN/Inf instead of refusing them.
        max_shard_size: Transformer shard limit (``"5GB"``); one shard is in memory at a time.

    Returns:
        A [`ConversionResult`].
    """
    dtype = _parse_dtype(dtype)
    max_shard_size = parse_size(max_shard_size)
    stored = tuple(f.name for f in fields(StudentSettings))
    unknown = sorted(set(settings) - set(stored))
    if unknown:
        raise ArgumentTypeError(f"`{unknown[0]}` is not a stored setting of `convert_checkpoint`; accepted: {stored}.")
    output = Path(output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise FileExistsError(f"--output {str(output)!r} exists and is not an empty directory; pick a new one.")
    if keep_lora and lora is None:
        raise ValueError("`keep_lora` keeps the LoRA given with `lora`; pass `lora` too.")
    if lora_alpha is not None and not (isinstance(lora_alpha, (int, float)) and 0 < lora_alpha < float("inf")):
        raise ValueError(f"`lora_alpha` must be a positive finite number, got {lora_alpha!r}.")
    base_dir = resolve_base(base)
    base_model = base_model_id or _hub_id(base)
    if base_model is None:
        logger.warning(
            f"--base {str(base)!r} is a local directory and no --base-model-id was given: the model card is written "
            "without `base_model`. Add `base_model: <hub id>` (e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers) to the front "
            "matter of README.md before uploading, or pass --base-model-id."
        )
    base_component_entries(base_dir)  # the components to copy, checked before anything is written

    loaded = load_checkpoint_safely(checkpoint)
    detected = detect_format(loaded, format, path=checkpoint)
    logger.info(f"Found {detected.description}.")
    row = get_format(detected.format)
    copy = detected.select(ema)
    weights = detected.copies[copy]
    key_map = diffusers_key_map(weights)

    sampling = row.sampling.replace(**settings)
    config = _causal_config(base_dir, sampling.chunk_size, sampling.independent_first_frame)
    with init_empty_weights():
        meta_model = WanCausalTransformer3DModel.from_config(config)
    expected = {key: value.shape for key, value in meta_model.state_dict().items()}
    sources = {name: _source_shape_dtype(weights, source) for name, source in key_map.items()}
    check_state_dict({name: shape for name, (shape, _) in sources.items()}, expected)
    not_float = sorted(
        f"{key_map[name]}: {source_dtype}"
        for name, (_, source_dtype) in sources.items()
        if not (isinstance(source_dtype, torch.dtype) and source_dtype.is_floating_point)
    )
    if not_float:
        raise CheckpointConversionError(
            f"The checkpoint holds non-float weights (quantized or corrupt?), which a Wan transformer cannot take: "
            f"{not_float[:10]}."
        )

    lora_weights, lora_map, alpha = None, {}, None
    if lora is not None:
        lora_weights = load_lora_state_dict(lora)
        lora_map = lora_key_map(lora_weights)
        unknown = sorted(set(lora_map) - set(expected))
        if unknown:
            raise CheckpointConversionError(f"The LoRA adapts modules the transformer does not have: {unknown[:10]}.")
        misfit = [
            f"{name}: A {tuple(lora_weights[key_a].shape)}, B {tuple(lora_weights[key_b].shape)}, "
            f"W {tuple(expected[name])}"
            for name, (key_a, key_b) in lora_map.items()
            if len(expected[name]) != 2
            or lora_weights[key_a].shape[1:] != expected[name][1:]
            or lora_weights[key_b].shape[:1] != expected[name][:1]
            or lora_weights[key_a].shape[0] != lora_weights[key_b].shape[1]
        ]
        if misfit:
            raise CheckpointConversionError(
                f"LoRA shapes do not fit the weights (A (r, in), B (out, r)): {misfit[:5]}."
            )
        alpha = lora_alpha if lora_alpha is not None else row.lora_alpha

    def make_tensor(name: str) -> torch.Tensor:
        source = weights[key_map[name]]
        out_dtype = dtype or source.dtype
        if name in lora_map and not keep_lora:
            lora_a, lora_b = (lora_weights[key] for key in lora_map[name])
            tensor = merge_lora(source, lora_a, lora_b, alpha, out_dtype)
        else:
            tensor = source.to(out_dtype)
        bad = 0 if allow_non_finite else _non_finite(tensor)
        if bad:
            raise CheckpointConversionError(
                f"Weight {name!r} ({key_map[name]!r} in the checkpoint) holds {bad} NaN/Inf value(s)"
                f"{' after the cast to ' + str(out_dtype) if out_dtype != source.dtype else ''}; refusing to write "
                "a broken model (pass --allow-non-finite to convert it anyway)."
            )
        return tensor

    plan = {name: (expected[name], dtype or sources[name][1]) for name in expected}
    pipeline_keys = _pipeline_config_keys()
    settings = sampling.as_dict()
    pipeline_settings = tuple(key for key in settings if key in pipeline_keys or key in _MODEL_SETTINGS)
    pending = tuple(key for key in settings if key not in pipeline_settings)
    from ..pipelines import causal_scheduler_from_config

    scheduler = causal_scheduler_from_config(
        dict(FlowMatchEulerDiscreteScheduler.load_config(base_dir, subfolder="scheduler"))
    )
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(scheduler.config, shift=sampling.shift)

    with atomic_output_dir(output) as staging:
        (staging / "transformer").mkdir()
        meta_model.save_config(staging / "transformer")
        shards = write_sharded_safetensors(staging / "transformer", plan, make_tensor, max_shard_size)
        scheduler.save_pretrained(staging / "scheduler")
        copied = copy_base_components(base_dir, staging)
        index = {
            "_class_name": "WanCausalPipeline",
            "_diffusers_version": _diffusers_version(),
            **copied,
            "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
            "transformer": ["fastgen_diffusers", "WanCausalTransformer3DModel"],
            **{key: settings[key] for key in pipeline_settings if key not in _MODEL_SETTINGS},
        }
        (staging / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        make_hub_loadable(staging)
        sampling_record = {
            "format": row.name,
            "settings": settings,
            "read_by_pipeline": list(pipeline_settings),
            "pending_policy_settings": list(pending),
        }
        (staging / SAMPLING_FILE).write_text(json.dumps(sampling_record, indent=2) + "\n", encoding="utf-8")
        if keep_lora:
            _write_diffusers_lora(staging / LORA_WEIGHT_NAME, lora_weights, lora_map, alpha)
        result = ConversionResult(
            output=output,
            format=row.name,
            copy=copy,
            description=detected.description,
            sampling=sampling,
            pipeline_settings=pipeline_settings,
            pending_settings=pending,
            lora=None if lora is None else ("kept" if keep_lora else "merged"),
            shards=tuple(shards),
        )
        card = model_card(
            result, row=row, checkpoint=Path(checkpoint), lora_file=lora, base_model=base_model, dtype=dtype
        )
        (staging / "README.md").write_text(card, encoding="utf-8")
    return result


def _write_diffusers_lora(
    path: Path, lora: Mapping[str, torch.Tensor], lora_map: Mapping[str, tuple[str, str]], alpha: float | None
) -> None:
    """The adapter in diffusers' Wan LoRA naming; ``alpha / r`` is folded into ``lora_B`` (in float32) because
    diffusers loads PEFT LoRAs with alpha = r."""
    from safetensors.torch import save_file

    tensors = {}
    for name, (key_a, key_b) in lora_map.items():
        module = name.removesuffix(".weight")
        lora_a, lora_b = lora[key_a], lora[key_b]
        rank = lora_a.shape[0]
        if alpha is not None and float(alpha) != rank:
            lora_b = lora_b.float() * (float(alpha) / rank)
        tensors[f"transformer.{module}.lora_A.weight"] = lora_a.contiguous()
        tensors[f"transformer.{module}.lora_B.weight"] = lora_b.contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


def _diffusers_version() -> str:
    import diffusers

    return diffusers.__version__


def _hub_id(base: str | os.PathLike) -> str | None:
    """``base`` as a Hub id: itself when it is not a local path, ``org/name`` for a Hub cache snapshot; ``None`` for
    another local directory."""
    path = Path(base)
    if not path.exists():
        return str(base)
    for part in reversed(path.resolve().parts):
        if part.startswith("models--"):
            return part.removeprefix("models--").replace("--", "/", 1)
    return None
