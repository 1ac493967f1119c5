"""Convert research checkpoints (Self-Forcing, CausVid, FastGen) into causal diffusers pipeline directories.

The students people have are ``.pt`` files from research repos:

* **Self-Forcing** (``self_forcing_dmd.pt``, ``ode_init.pt``) and **CausVid** (``model.pt``):
  ``{"generator_ema": sd, "generator": sd}`` (or one of them), ``model.``-prefixed keys in the original Wan layout.
* **FastGen** (``{iteration:07d}.pth``): ``{"model": {"net": sd, "ema": sd, "fake_score": ..., ...}, ...}``,
  ``transformer.``-prefixed keys in the diffusers layout.

Files are read with ``torch.load(weights_only=True)`` or safetensors only: a pickle that holds anything but tensors
and plain containers is refused and nothing in it runs. Original Wan names are mapped with diffusers'
``convert_wan_transformer_to_diffusers`` (``self_attn`` -> ``attn1``, the ``norm2`` <-> ``norm3`` swap, ``head.head``
-> ``proj_out``, ``modulation`` -> ``scale_shift_table``, the I2V ``img_emb`` and ``k_img``/``v_img``), and every key
must land on a parameter of the base transformer config with the right shape.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import re
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import init_empty_weights
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from diffusers.utils import logging

from .models import WanCausalTransformer3DModel

logger = logging.get_logger(__name__)  # pylint: disable=invalid-name

FORMATS = ("auto", "self-forcing", "causvid", "fastgen")

# Segments that training wrappers (FSDP, activation checkpointing, torch.compile, DDP) insert into parameter names.
_WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
# Training-only heads of FastGen's ``net`` (loss weighting); they take no part in sampling.
_TRAINING_ONLY_PREFIXES = ("logvar_linear.",)
# Original Wan names that ``convert_wan_transformer_to_diffusers`` leaves alone (FLF2V's image position embedding).
_EXTRA_ORIGINAL_RENAMES = {"img_emb.emb_pos": "condition_embedder.image_embedder.pos_embed"}
_MAX_LISTED = 25


class CheckpointConversionError(ValueError):
    """A checkpoint does not have the structure, keys or shapes the conversion expects."""


class UnsafeCheckpointError(CheckpointConversionError):
    """A pickle holds objects other than tensors and plain containers; it was refused without running it."""


@dataclass(frozen=True)
class SamplingSettings:
    """How a few-step causal student samples; written into the converted pipeline so ``pipe(prompt)`` uses it.

    Args:
        timesteps: Model-scale denoising timesteps of every chunk, in ``(0, 1000]``, descending, without the final 0
            (Self-Forcing's warped ``denoising_step_list``, FastGen's ``t_list * 1000``).
        shift: Flow-matching shift of the scheduler (already folded into ``timesteps``).
        context_noise: Model-scale timestep of the pass that stores a finished chunk in the KV cache (0: clean).
        chunk_size: Latent frames per causal chunk (``num_frame_per_block``).
        independent_first_frame: Whether the first latent frame is a chunk of its own.
    """

    timesteps: tuple[float, ...]
    shift: float
    context_noise: float = 0.0
    chunk_size: int = 3
    independent_first_frame: bool = False

    def __post_init__(self):
        ts = tuple(float(t) for t in self.timesteps)
        if not ts or any(not 0 < t <= 1000 for t in ts) or any(a <= b for a, b in zip(ts, ts[1:])):
            raise ValueError(f"`timesteps` must be strictly descending values in (0, 1000], got {list(ts)}.")
        if self.chunk_size < 1:
            raise ValueError(f"`chunk_size` must be a positive number of latent frames, got {self.chunk_size}.")
        if not 0 <= self.context_noise < 1000:
            raise ValueError(f"`context_noise` must be a model-scale timestep in [0, 1000), got {self.context_noise}.")
        object.__setattr__(self, "timesteps", ts)

    @property
    def num_inference_steps(self) -> int:
        """Denoising steps per chunk."""
        return len(self.timesteps)


def warp_timesteps(indices: Sequence[float], shift: float) -> tuple[float, ...]:
    """Self-Forcing's ``warp_denoising_step``: map ``denoising_step_list`` indices to shifted model timesteps.

    ``t = 1000 * shift * s / (1 + (shift - 1) * s)`` with ``s = index / 1000``; ``[1000, 750, 500, 250]`` with shift 5
    gives ``[1000, 937.5, 833.33, 625]``.
    """
    warped = []
    for index in indices:
        sigma = float(index) / 1000.0
        warped.append(1000.0 * shift * sigma / (1.0 + (shift - 1.0) * sigma))
    return tuple(warped)


# The released configs of each family (Self-Forcing ``self_forcing_dmd.yaml``, CausVid ``wan_causal_dmd.yaml``,
# FastGen ``config_sf.py``/``config_causvid.py``).
DEFAULT_SAMPLING: dict[str, SamplingSettings] = {
    "self-forcing": SamplingSettings(timesteps=warp_timesteps([1000, 750, 500, 250], 5.0), shift=5.0),
    "causvid": SamplingSettings(timesteps=(1000.0, 757.0, 522.0), shift=8.0),
    "fastgen": SamplingSettings(timesteps=(999.0, 937.0, 833.0, 624.0), shift=5.0),
}


def load_checkpoint_safely(path: str | os.PathLike) -> Any:
    """Load a checkpoint without running code from it: safetensors, or ``torch.load(weights_only=True)``.

    Raises:
        UnsafeCheckpointError: the pickle references anything but tensors and plain containers (a class, a function,
            ``__reduce__`` payloads); the unpickler stops at the first such reference, so nothing in it ran.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Checkpoint {str(path)!r} does not exist or is not a file.")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path), device="cpu")
    try:
        # mmap keeps multi-GB zip checkpoints out of RAM until their tensors are used; legacy pickles cannot mmap.
        return torch.load(path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path))
    except pickle.UnpicklingError as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UnsafeCheckpointError(
            f"Refused to load {str(path)!r}: its pickle holds objects other than tensors and plain containers "
            f"(dict, list, tuple, str, numbers), so it is not a plain weights file. Nothing in it was executed. "
            f"torch says: {reason}\nIf you trust the file, load it yourself in an isolated environment and save only "
            f"its state dicts (e.g. `torch.save({{'generator_ema': ckpt['generator_ema']}}, 'weights.pt')` or "
            f"safetensors), then convert that."
        ) from None


@dataclass
class DetectedCheckpoint:
    """What :func:`detect_format` found in a loaded checkpoint.

    Attributes:
        format: ``"self-forcing"``, ``"causvid"`` or ``"fastgen"``.
        copies: Candidate weight copies by name (``generator_ema``, ``generator``, ``net``, ``ema``, ...).
        ema_copies: Names in ``copies`` that are EMA weights.
        description: One line saying what was found (shown by the CLI).
    """

    format: str
    copies: dict[str, Mapping[str, torch.Tensor]]
    ema_copies: tuple[str, ...]
    description: str

    def select(self, ema: bool | str | None = None) -> str:
        """Name of the copy to convert: ``ema=None`` takes the EMA copy when there is exactly one, else the regular
        one; ``True`` requires an EMA copy, ``False`` the regular one, a string names the copy."""
        regular = [name for name in self.copies if name not in self.ema_copies]
        if isinstance(ema, str):
            if ema not in self.copies:
                raise CheckpointConversionError(
                    f"No weight copy {ema!r} in the checkpoint; it has {list(self.copies)}."
                )
            return ema
        if ema is None:
            if len(self.ema_copies) > 1:
                raise CheckpointConversionError(
                    f"The checkpoint has several EMA copies {list(self.ema_copies)}; pick one by name "
                    f"(`ema=NAME`, CLI `--ema-key NAME`) or the regular weights with `ema=False` (`--no-ema`)."
                )
            ema = bool(self.ema_copies)
        if ema:
            if not self.ema_copies:
                raise CheckpointConversionError(
                    f"An EMA copy was requested but the checkpoint has none; it has {list(self.copies)}. "
                    "Convert the regular weights with `ema=False` (`--no-ema`)."
                )
            if len(self.ema_copies) > 1:
                raise CheckpointConversionError(
                    f"The checkpoint has several EMA copies {list(self.ema_copies)}; pick one by name."
                )
            return self.ema_copies[0]
        if not regular:
            raise CheckpointConversionError(
                f"The regular (non-EMA) weights were requested but the checkpoint only has {list(self.copies)}. "
                "Convert the EMA copy with `ema=True` (`--ema`)."
            )
        return regular[0]


def _is_state_dict(value: Any) -> bool:
    return isinstance(value, Mapping) and bool(value) and all(isinstance(v, torch.Tensor) for v in value.values())


def _describe_keys(mapping: Mapping) -> str:
    keys = list(mapping)
    shown = ", ".join(repr(k) for k in keys[:10])
    return f"[{shown}{', ...' if len(keys) > 10 else ''}]"


def detect_format(checkpoint: Any, format: str = "auto") -> DetectedCheckpoint:
    """Find the weight copies of a loaded checkpoint and its family.

    Self-Forcing and CausVid files have the same structure (``generator_ema`` / ``generator``); ``auto`` reports them
    as ``self-forcing`` (whose sampling defaults apply) unless ``format="causvid"`` is given.

    Raises:
        CheckpointConversionError: the structure is neither layout, or it contradicts an explicit ``format``.
    """
    if format not in FORMATS:
        raise ValueError(f"`format` must be one of {FORMATS}, got {format!r}.")
    if not isinstance(checkpoint, Mapping):
        raise CheckpointConversionError(
            f"Expected a checkpoint dict ({{'generator_ema', 'generator'}} or {{'model': {{'net', 'ema'}}}}), "
            f"got {type(checkpoint).__name__}."
        )
    generators = [name for name in ("generator_ema", "generator") if _is_state_dict(checkpoint.get(name))]
    model = checkpoint.get("model")
    if generators:
        found = "self-forcing" if format == "auto" else format
        copies = {name: checkpoint[name] for name in generators}
        ema_copies = tuple(name for name in generators if name == "generator_ema")
        layout = _state_dict_layout(copies[generators[0]])
        description = f"Self-Forcing/CausVid checkpoint ({layout} Wan keys) with weight copies {generators}" + (
            "; treated as Self-Forcing, pass --format causvid for a CausVid file" if format == "auto" else ""
        )
        if found == "fastgen":
            raise CheckpointConversionError(
                f"--format fastgen expects {{'model': {{'net': ..., 'ema': ...}}}}, but found {description}."
            )
    elif isinstance(model, Mapping) and any(_is_state_dict(v) for v in model.values()):
        found = "fastgen"
        names = [name for name, value in model.items() if _is_state_dict(value)]
        ema_copies = tuple(name for name in names if name.startswith("ema"))
        selectable = [name for name in names if name == "net" or name in ema_copies]
        if not selectable:
            raise CheckpointConversionError(
                f"FastGen checkpoint has no 'net' or 'ema*' weights under 'model'; it has {names}."
            )
        copies = {name: model[name] for name in selectable}
        skipped = [name for name in names if name not in selectable]
        layout = _state_dict_layout(copies[selectable[0]])
        description = f"FastGen checkpoint ({layout} Wan keys) with weight copies {selectable}" + (
            f" (ignoring training-only {skipped})" if skipped else ""
        )
        if format not in ("auto", "fastgen"):
            raise CheckpointConversionError(
                f"--format {format} expects {{'generator_ema': ..., 'generator': ...}}, but found {description}."
            )
    elif _is_state_dict(checkpoint):
        found = "self-forcing" if format == "auto" else format
        copies, ema_copies = {"state_dict": checkpoint}, ()
        layout = _state_dict_layout(checkpoint)
        description = f"bare state dict ({layout} Wan keys, no EMA copy)" + (
            "; Self-Forcing sampling defaults apply, pass --format to pick another family" if format == "auto" else ""
        )
    else:
        raise CheckpointConversionError(
            "Unrecognised checkpoint: expected {'generator_ema': state_dict, 'generator': state_dict} "
            "(Self-Forcing/CausVid) or {'model': {'net': state_dict, 'ema': state_dict}} (FastGen) or a flat "
            f"state dict of tensors, got top-level keys {_describe_keys(checkpoint)}."
        )
    return DetectedCheckpoint(format=found, copies=copies, ema_copies=ema_copies, description=description)


def _unwrap_key(key: str) -> str:
    """``key`` without the segments training wrappers insert (FSDP, activation checkpointing, torch.compile)."""
    for segment in _WRAPPER_SEGMENTS:
        key = key.replace(segment, "")
    return key


def _strip_key(key: str) -> str:
    """``key`` unwrapped and without the ``model.`` (original) or ``transformer.`` (FastGen) prefix."""
    return _unwrap_key(key).removeprefix("model.").removeprefix("transformer.")


def _strip(state_dict: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """``state_dict`` with unwrapped keys and ``prefix`` removed where it starts a key."""
    return {_unwrap_key(key).removeprefix(prefix): value for key, value in state_dict.items()}


def _state_dict_layout(state_dict: Mapping[str, torch.Tensor]) -> str:
    """``"original"`` (Wan repo names) or ``"diffusers"``, judged by the attention module names."""
    keys = [_strip_key(key) for key in state_dict]
    if any(".self_attn." in k or ".cross_attn." in k or k.startswith("head.") for k in keys):
        return "original"
    if any(".attn1." in k or ".attn2." in k or k.startswith(("proj_out.", "condition_embedder.")) for k in keys):
        return "diffusers"
    raise CheckpointConversionError(
        f"Cannot tell the key layout: neither original Wan names (`self_attn`, `cross_attn`, `head.head`) nor "
        f"diffusers names (`attn1`, `attn2`, `proj_out`) appear in {_describe_keys(state_dict)}."
    )


def original_to_diffusers_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename an original-layout Wan state dict (optionally ``model.``-prefixed) to diffusers names.

    Uses diffusers' ``convert_wan_transformer_to_diffusers`` rename table. Tensors are not copied.

    Raises:
        CheckpointConversionError: two keys land on the same diffusers name, or the checkpoint is a Wan-Animate one.
    """
    state_dict = _strip(state_dict, "model.")
    unsupported = [k for k in state_dict if k.startswith(("motion_encoder.", "face_adapter."))]
    if unsupported:
        raise CheckpointConversionError(f"Wan-Animate weights are not supported: {unsupported[:_MAX_LISTED]}.")
    # Renaming key -> key maps every new name to the name it came from, without touching the tensors.
    renamed = convert_wan_transformer_to_diffusers({key: key for key in state_dict})
    sources: dict[str, list[str]] = {}
    for new_key, old_key in renamed.items():
        for original, diffusers_name in _EXTRA_ORIGINAL_RENAMES.items():
            new_key = new_key.replace(original, diffusers_name)
        sources.setdefault(new_key, []).append(old_key)
    missing_sources = set(state_dict) - {old for olds in sources.values() for old in olds}
    collisions = {new: olds for new, olds in sources.items() if len(olds) > 1}
    if collisions or missing_sources:
        raise CheckpointConversionError(
            f"Original keys collide after renaming: {collisions or sorted(missing_sources)}; the checkpoint holds "
            "the same parameter under two names."
        )
    return {new_key: state_dict[olds[0]] for new_key, olds in sources.items()}


def to_diffusers_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Diffusers-named transformer weights from either layout (``model.`` original or ``transformer.`` diffusers keys).

    FastGen's training-only heads (``logvar_linear``) are dropped; everything else is kept for validation.
    """
    if _state_dict_layout(state_dict) == "original":
        return original_to_diffusers_state_dict(state_dict)
    converted = _strip(state_dict, "transformer.")
    dropped = [k for k in converted if k.startswith(_TRAINING_ONLY_PREFIXES)]
    if dropped:
        logger.info(f"Dropping training-only weights: {dropped}")
    return {k: v for k, v in converted.items() if k not in dropped}


def _listing(items: Sequence[str]) -> str:
    shown = "\n".join(f"    {item}" for item in items[:_MAX_LISTED])
    more = f"\n    ... and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else ""
    return shown + more


def check_state_dict(state_dict: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Size]) -> None:
    """Require exactly the expected keys with the expected shapes.

    Raises:
        CheckpointConversionError: listing every unexpected key, missing key and shape mismatch.
    """
    unexpected = sorted(set(state_dict) - set(expected))
    missing = sorted(set(expected) - set(state_dict))
    mismatched = sorted(
        f"{key}: checkpoint {tuple(state_dict[key].shape)}, base config expects {tuple(expected[key])}"
        for key in set(state_dict) & set(expected)
        if tuple(state_dict[key].shape) != tuple(expected[key])
    )
    problems = []
    if unexpected:
        problems.append(f"  {len(unexpected)} key(s) that map to no parameter of the base transformer:\n")
        problems[-1] += _listing(unexpected)
    if missing:
        problems.append(f"  {len(missing)} parameter(s) of the base transformer missing from the checkpoint:\n")
        problems[-1] += _listing(missing)
    if mismatched:
        problems.append(f"  {len(mismatched)} shape mismatch(es):\n" + _listing(mismatched))
    if problems:
        raise CheckpointConversionError(
            "The checkpoint does not fit the base transformer config (is --base the model it was trained from?):\n"
            + "\n".join(problems)
        )


@dataclass
class ConversionResult:
    """What :func:`convert_checkpoint` wrote.

    Attributes:
        output: The pipeline directory.
        format: Checkpoint family (``self-forcing``, ``causvid``, ``fastgen``).
        copy: Name of the converted weight copy (``generator_ema``, ``net``, ...).
        description: What format detection found.
        sampling: The sampling settings stored in the pipeline.
    """

    output: Path
    format: str
    copy: str
    description: str
    sampling: SamplingSettings


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
    copy unless ``dtype`` casts them).

    Raises:
        CheckpointConversionError: unexpected or missing keys, or shapes that do not fit the base config.
    """
    config = dict(WanCausalTransformer3DModel.load_config(base, subfolder="transformer"))
    if chunk_size is not None:
        config["chunk_size"] = chunk_size
    if independent_first_frame is not None:
        config["independent_first_frame"] = independent_first_frame
    with init_empty_weights():
        transformer = WanCausalTransformer3DModel.from_config(config)
    check_state_dict(state_dict, {key: value.shape for key, value in transformer.state_dict().items()})
    tensors = {}
    for key, value in state_dict.items():
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        tensors[key] = value.contiguous()
    transformer.load_state_dict(tensors, strict=True, assign=True)
    return transformer.eval()


def convert_checkpoint(
    checkpoint: str | os.PathLike,
    *,
    base: str | os.PathLike,
    output: str | os.PathLike,
    format: str = "auto",
    ema: bool | str | None = None,
    dtype: torch.dtype | str | None = None,
    chunk_size: int | None = None,
    timesteps: Sequence[float] | None = None,
    shift: float | None = None,
    context_noise: float | None = None,
    independent_first_frame: bool | None = None,
    base_model_id: str | None = None,
) -> ConversionResult:
    """Convert a Self-Forcing / CausVid / FastGen checkpoint into a [`WanCausalPipeline`] directory.

    Args:
        checkpoint: The ``.pt`` / ``.pth`` / ``.safetensors`` file.
        base: Diffusers Wan directory or Hub id: text encoder, tokenizer, VAE, scheduler and transformer config.
        output: Directory to write (safetensors weights, ``model_index.json`` with the sampling settings, README.md).
        format: ``"auto"``, ``"self-forcing"``, ``"causvid"`` or ``"fastgen"``; picks the default sampling settings.
        ema: ``None`` (EMA when the checkpoint has one), ``True``, ``False`` or the name of a weight copy.
        dtype: Cast the transformer weights (``"bfloat16"``, ``torch.float16``, ...); default: keep the checkpoint's.
        chunk_size, timesteps, shift, context_noise, independent_first_frame: Override the format's defaults
            (see [`SamplingSettings`]).
        base_model_id: Hub id written as ``base_model`` in the model card (default: ``base`` when it is a Hub id).

    Returns:
        A [`ConversionResult`].
    """
    from .pipelines import WanCausalPipeline, causal_scheduler_from_config

    dtype = _parse_dtype(dtype)
    output = Path(output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise FileExistsError(f"--output {str(output)!r} exists and is not an empty directory; pick a new one.")
    loaded = load_checkpoint_safely(checkpoint)
    detected = detect_format(loaded, format)
    logger.info(f"Found {detected.description}.")
    copy = detected.select(ema)
    state_dict = to_diffusers_state_dict(detected.copies[copy])

    defaults = DEFAULT_SAMPLING[detected.format]
    sampling = SamplingSettings(
        timesteps=defaults.timesteps if timesteps is None else tuple(timesteps),
        shift=defaults.shift if shift is None else shift,
        context_noise=defaults.context_noise if context_noise is None else context_noise,
        chunk_size=defaults.chunk_size if chunk_size is None else chunk_size,
        independent_first_frame=(
            defaults.independent_first_frame if independent_first_frame is None else independent_first_frame
        ),
    )
    transformer = build_transformer(
        state_dict,
        base,
        chunk_size=sampling.chunk_size,
        independent_first_frame=sampling.independent_first_frame,
        dtype=dtype,
    )
    del loaded, state_dict

    scheduler = causal_scheduler_from_config(FlowMatchEulerDiscreteScheduler.load_config(base, subfolder="scheduler"))
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(scheduler.config, shift=sampling.shift)
    pipe = WanCausalPipeline.from_pretrained(base, transformer=transformer, scheduler=scheduler)
    # Defaults of `pipe(...)`: chunking lives in the transformer config, the shift in the scheduler config, and the
    # timesteps and context noise in model_index.json (the pipeline's config).
    pipe.register_to_config(timesteps=list(sampling.timesteps), context_noise=sampling.context_noise)
    pipe.save_pretrained(output, safe_serialization=True)

    result = ConversionResult(
        output=output, format=detected.format, copy=copy, description=detected.description, sampling=sampling
    )
    card = model_card(
        result,
        checkpoint=Path(checkpoint),
        base_model=base_model_id or _hub_id(base),
        dtype=dtype,
    )
    (output / "README.md").write_text(card, encoding="utf-8")
    return result


def _parse_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    parsed = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(parsed, torch.dtype) or not parsed.is_floating_point:
        raise ValueError(f"`dtype` must name a floating point torch dtype (e.g. 'bfloat16'), got {dtype!r}.")
    return parsed


def _hub_id(base: str | os.PathLike) -> str:
    """``base`` as a Hub id: itself when it is not a local path, ``org/name`` for a Hub cache snapshot."""
    path = Path(base)
    if not path.exists():
        return str(base)
    for part in reversed(path.resolve().parts):
        if part.startswith("models--"):
            return part.removeprefix("models--").replace("--", "/", 1)
    logger.warning(
        f"--base {str(base)!r} is a local directory; the model card's `base_model` needs a Hub id, pass it with "
        "--base-model-id (e.g. Wan-AI/Wan2.1-T2V-1.3B-Diffusers)."
    )
    return str(base)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


_FORMAT_TITLES = {"self-forcing": "Self-Forcing", "causvid": "CausVid", "fastgen": "FastGen"}


def model_card(result: ConversionResult, *, checkpoint: Path, base_model: str, dtype: torch.dtype | None) -> str:
    """The converted pipeline's README.md: YAML front matter, install and usage, sampling settings, provenance."""
    from . import __version__

    sampling = result.sampling
    family = _FORMAT_TITLES[result.format]
    tags = ["fastgen-diffusers", "text-to-video", "video-generation", "causal", "autoregressive", "wan", result.format]
    front_matter = "\n".join(
        [
            "---",
            "library_name: diffusers",
            "pipeline_tag: text-to-video",
            f"base_model: {json.dumps(base_model)}",
            "tags:",
            *(f"- {tag}" for tag in tags),
            "# license: set the license of the source checkpoint and of the base model",
            "---",
        ]
    )
    timesteps = ", ".join(f"{t:.10g}" for t in sampling.timesteps)
    is_hub_id = re.fullmatch(r"[\w.-]+/[\w.-]+", base_model) and not Path(base_model).exists()
    base_link = f"[`{base_model}`](https://huggingface.co/{base_model})" if is_hub_id else f"`{base_model}`"
    return f"""{front_matter}

# Causal Wan student ({family})

A few-step, chunk-by-chunk (autoregressive, KV-cached) Wan text-to-video model converted from a {family}
checkpoint with [fastgen-diffusers](https://pypi.org/project/fastgen-diffusers/). The text encoder, tokenizer, VAE
and transformer config come from {base_link}.

## Install

```bash
pip install fastgen-diffusers
```

## Usage

The sampling settings below are stored with the pipeline (transformer and scheduler configs, `model_index.json`),
so `pipe(prompt)` uses them without arguments.

```python
import torch
from diffusers.utils import export_to_video

from fastgen_diffusers import WanCausalPipeline

pipe = WanCausalPipeline.from_pretrained("path/or/hub-id/of/this/model", torch_dtype=torch.bfloat16).to("cuda")
video = pipe("A red fox runs through fresh snow, cinematic lighting").frames[0]
export_to_video(video, "fox.mp4", fps=16)
```

## Sampling settings

| setting | value |
|---|---|
| denoising timesteps per chunk (model scale) | {timesteps} |
| steps per chunk | {sampling.num_inference_steps} |
| shift | {sampling.shift:g} |
| context noise (timestep of the cache pass) | {sampling.context_noise:g} |
| chunk size (latent frames) | {sampling.chunk_size} |
| independent first frame | {str(sampling.independent_first_frame).lower()} |

Spelled out, the default call is `pipe(prompt, timesteps=[{timesteps}], context_noise={sampling.context_noise:g})`.

## Source checkpoint

| | |
|---|---|
| file | `{checkpoint.name}` |
| sha256 | `{_sha256(checkpoint)}` |
| detected | {result.description} |
| converted weights | `{result.copy}` |
| dtype | {str(dtype).removeprefix("torch.") if dtype is not None else "as stored in the checkpoint"} |
| converter | fastgen-diffusers {__version__} |

## License

Set the license of this model from the licenses of the source checkpoint and of the base model.
"""


def add_convert_subparser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``convert`` on a ``fastgen-diffusers`` subparsers object (``func=run_convert``)."""
    parser = subparsers.add_parser(
        "convert",
        help="convert a Self-Forcing / CausVid / FastGen checkpoint into a causal diffusers pipeline",
        description=(
            "Convert a research checkpoint into a WanCausalPipeline directory (safetensors, model card, sampling "
            "settings). Checkpoints are read with torch.load(weights_only=True) or safetensors: a pickle holding "
            "anything but tensors and plain containers is refused and nothing in it runs."
        ),
    )
    parser.add_argument("--checkpoint", required=True, help="the .pt / .pth / .safetensors file")
    parser.add_argument("--format", choices=FORMATS, default="auto", help="checkpoint family (default: auto)")
    parser.add_argument(
        "--ema",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="convert the EMA copy (default: yes when the checkpoint has one) or, with --no-ema, the regular one",
    )
    parser.add_argument("--ema-key", default=None, help="name of the weight copy when there are several EMA copies")
    parser.add_argument("--base", required=True, help="diffusers Wan directory or Hub id (text encoder, VAE, config)")
    parser.add_argument("--output", required=True, help="directory to write")
    parser.add_argument("--dtype", default=None, help="cast the transformer weights, e.g. bfloat16 (default: keep)")
    parser.add_argument("--chunk-size", type=int, default=None, help="latent frames per causal chunk (default: 3)")
    parser.add_argument(
        "--timesteps",
        type=float,
        nargs="+",
        default=None,
        help="model-scale denoising timesteps per chunk, descending, without 0 (default: the format's released list)",
    )
    parser.add_argument(
        "--warp-shift",
        type=float,
        default=None,
        help="treat --timesteps as Self-Forcing denoising_step_list indices and warp them with this shift",
    )
    parser.add_argument("--shift", type=float, default=None, help="flow-matching shift (default: the format's)")
    parser.add_argument(
        "--context-noise", type=float, default=None, help="timestep of the pass that caches a chunk (default: 0)"
    )
    parser.add_argument(
        "--independent-first-frame",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the first latent frame is a chunk of its own (default: no)",
    )
    parser.add_argument("--base-model-id", default=None, help="Hub id for the model card's base_model")
    parser.set_defaults(func=run_convert)
    return parser


def run_convert(args: argparse.Namespace) -> int:
    """Run ``fastgen-diffusers convert`` from parsed arguments; prints what was found and written."""
    if args.ema_key is not None and args.ema is False:
        raise SystemExit("--ema-key names an EMA copy; it cannot be combined with --no-ema.")
    timesteps = args.timesteps
    if args.warp_shift is not None:
        if timesteps is None:
            raise SystemExit("--warp-shift warps the indices given with --timesteps; pass --timesteps too.")
        timesteps = warp_timesteps(timesteps, args.warp_shift)
        args.shift = args.warp_shift if args.shift is None else args.shift
    try:
        result = convert_checkpoint(
            args.checkpoint,
            base=args.base,
            output=args.output,
            format=args.format,
            ema=args.ema_key if args.ema_key is not None else args.ema,
            dtype=args.dtype,
            chunk_size=args.chunk_size,
            timesteps=timesteps,
            shift=args.shift,
            context_noise=args.context_noise,
            independent_first_frame=args.independent_first_frame,
            base_model_id=args.base_model_id,
        )
    except (CheckpointConversionError, FileExistsError) as error:
        raise SystemExit(f"error: {error}") from None
    print(f"Found {result.description}.")
    print(f"Converted {result.copy!r} to {result.output} with sampling settings {asdict(result.sampling)}.")
    return 0
