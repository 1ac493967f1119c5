"""State-dict mapping: original Wan (or FastGen diffusers) names to diffusers names, validation, LoRA merging.

Mapping works on key names only (``{diffusers_name: source_name}``), so a converter can validate a checkpoint and
then read each tensor once, when it writes it. Original Wan names are mapped with diffusers'
``convert_wan_transformer_to_diffusers`` (``self_attn`` -> ``attn1``, the ``norm2`` <-> ``norm3`` swap, ``head.head``
-> ``proj_out``, ``modulation`` -> ``scale_shift_table``, the I2V ``img_emb`` and ``k_img``/``v_img``), and every key
must land on a parameter of the base transformer config with the right shape.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers
from diffusers.utils import logging

__all__ = [
    "CheckpointConversionError",
    "check_state_dict",
    "diffusers_key_map",
    "lora_key_map",
    "merge_lora",
    "original_to_diffusers_state_dict",
    "to_diffusers_state_dict",
]

logger = logging.get_logger(__name__)  # pylint: disable=invalid-name

# Segments that training wrappers (FSDP, activation checkpointing, torch.compile, DDP) insert into parameter names,
# at the top (``model._fsdp_wrapped_module.``) or nested inside blocks.
WRAPPER_SEGMENTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")
# Training-only heads of FastGen's ``net`` (loss weighting); they take no part in sampling.
TRAINING_ONLY_PREFIXES = ("logvar_linear.",)
# Original Wan names that ``convert_wan_transformer_to_diffusers`` leaves alone (FLF2V's image position embedding).
EXTRA_ORIGINAL_RENAMES = {"img_emb.emb_pos": "condition_embedder.image_embedder.pos_embed"}
PEFT_PREFIX = "base_model.model."
MAX_LISTED = 25


class CheckpointConversionError(ValueError):
    """A checkpoint does not have the structure, keys or shapes the conversion expects."""


def has_wrapper_segment(key: str) -> bool:
    return any(segment in key for segment in WRAPPER_SEGMENTS)


def unwrap_key(key: str) -> str:
    """``key`` without the segments training wrappers insert (FSDP, activation checkpointing, torch.compile)."""
    for segment in WRAPPER_SEGMENTS:
        key = key.replace(segment, "")
    return key


def strip_key(key: str) -> str:
    """``key`` unwrapped and without the ``model.`` (original) or ``transformer.`` (FastGen) prefix."""
    return unwrap_key(key).removeprefix("model.").removeprefix("transformer.")


def _describe(keys: Sequence[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:10])
    return f"[{shown}{', ...' if len(keys) > 10 else ''}]"


def state_dict_layout(keys: Iterable[str]) -> str:
    """``"original"`` (Wan repo names) or ``"diffusers"``, judged by the attention module names."""
    keys = list(keys)
    stripped = [strip_key(key) for key in keys]
    if any(".self_attn." in k or ".cross_attn." in k or k.startswith("head.") for k in stripped):
        return "original"
    if any(".attn1." in k or ".attn2." in k or k.startswith(("proj_out.", "condition_embedder.")) for k in stripped):
        return "diffusers"
    raise CheckpointConversionError(
        f"Cannot tell the key layout: neither original Wan names (`self_attn`, `cross_attn`, `head.head`) nor "
        f"diffusers names (`attn1`, `attn2`, `proj_out`) appear in {_describe(keys)}."
    )


def _stripped_sources(keys: Iterable[str], prefix: str) -> dict[str, str]:
    """``{stripped_name: source_name}``; two source keys that strip to one name (a wrapped and an unwrapped copy of
    the same parameter) are an error, not a silent pick."""
    sources: dict[str, list[str]] = {}
    for key in keys:
        sources.setdefault(unwrap_key(key).removeprefix(prefix), []).append(key)
    collisions = {name: olds for name, olds in sources.items() if len(olds) > 1}
    if collisions:
        shown = dict(list(collisions.items())[:MAX_LISTED])
        raise CheckpointConversionError(
            f"Keys collide once wrapper segments and prefixes are stripped: {shown}; the checkpoint holds the same "
            "parameter under two names."
        )
    return {name: olds[0] for name, olds in sources.items()}


def _original_renames(names: Iterable[str]) -> dict[str, str]:
    """``{diffusers_name: original_name}`` for unprefixed original Wan names (diffusers' rename table)."""
    names = list(names)
    unsupported = [k for k in names if k.startswith(("motion_encoder.", "face_adapter."))]
    if unsupported:
        raise CheckpointConversionError(f"Wan-Animate weights are not supported: {unsupported[:MAX_LISTED]}.")
    # Renaming key -> key maps every new name to the name it came from, without touching any tensor.
    renamed = convert_wan_transformer_to_diffusers({key: key for key in names})
    sources: dict[str, list[str]] = {}
    for new_key, old_key in renamed.items():
        for original, diffusers_name in EXTRA_ORIGINAL_RENAMES.items():
            new_key = new_key.replace(original, diffusers_name)
        sources.setdefault(new_key, []).append(old_key)
    missing_sources = set(names) - {old for olds in sources.values() for old in olds}
    collisions = {new: olds for new, olds in sources.items() if len(olds) > 1}
    if collisions or missing_sources:
        raise CheckpointConversionError(
            f"Original keys collide after renaming: {collisions or sorted(missing_sources)}; the checkpoint holds "
            "the same parameter under two names."
        )
    return {new_key: olds[0] for new_key, olds in sources.items()}


def diffusers_key_map(keys: Iterable[str]) -> dict[str, str]:
    """``{diffusers_name: source_key}`` for a checkpoint's keys in either layout.

    Wrapper segments (also nested inside blocks) are stripped, the ``model.`` prefix may be present or missing, and
    FastGen's ``transformer.``-prefixed diffusers keys lose their prefix and training-only heads.
    """
    keys = list(keys)
    if state_dict_layout(keys) == "original":
        stripped = _stripped_sources(keys, "model.")
        return {new: stripped[old] for new, old in _original_renames(stripped).items()}
    stripped = _stripped_sources(keys, "transformer.")
    dropped = [k for k in stripped if k.startswith(TRAINING_ONLY_PREFIXES)]
    if dropped:
        logger.info(f"Dropping training-only weights: {dropped}")
    return {name: source for name, source in stripped.items() if name not in dropped}


def to_diffusers_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Diffusers-named transformer weights from either layout (``model.`` original or ``transformer.`` diffusers keys).

    FastGen's training-only heads (``logvar_linear``) are dropped; everything else is kept for validation. Tensors are
    not copied.
    """
    return {name: state_dict[source] for name, source in diffusers_key_map(state_dict).items()}


def original_to_diffusers_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename an original-layout Wan state dict (optionally ``model.``-prefixed or wrapped) to diffusers names.

    Raises:
        CheckpointConversionError: two keys land on the same diffusers name, or the checkpoint is a Wan-Animate one.
    """
    stripped = _stripped_sources(state_dict, "model.")
    return {new: state_dict[stripped[old]] for new, old in _original_renames(stripped).items()}


def _listing(items: Sequence[str]) -> str:
    more = f", ... and {len(items) - MAX_LISTED} more" if len(items) > MAX_LISTED else ""
    return ", ".join(items[:MAX_LISTED]) + more


def check_state_dict(
    state_dict: Mapping[str, torch.Tensor | torch.Size | Sequence[int]], expected: Mapping[str, torch.Size]
) -> None:
    """Require exactly the expected keys with the expected shapes (values may be tensors or shapes).

    Raises:
        CheckpointConversionError: listing every unexpected key, missing key and shape mismatch.
    """

    def shape(value) -> tuple[int, ...]:
        return tuple(value.shape) if isinstance(value, torch.Tensor) else tuple(value)

    unexpected = sorted(set(state_dict) - set(expected))
    missing = sorted(set(expected) - set(state_dict))
    mismatched = sorted(
        f"{key}: checkpoint {shape(state_dict[key])}, base config expects {tuple(expected[key])}"
        for key in set(state_dict) & set(expected)
        if shape(state_dict[key]) != tuple(expected[key])
    )
    problems = []
    if unexpected:
        problems.append(
            f"{len(unexpected)} key(s) that map to no parameter of the base transformer ({_listing(unexpected)})"
        )
    if missing:
        problems.append(
            f"{len(missing)} parameter(s) of the base transformer missing from the checkpoint ({_listing(missing)})"
        )
    if mismatched:
        problems.append(f"{len(mismatched)} shape mismatch(es) ({_listing(mismatched)})")
    if problems:
        raise CheckpointConversionError(
            "The checkpoint does not fit the base transformer config (is --base the model it was trained from?): "
            + "; ".join(problems)
            + "."
        )


def lora_key_map(lora: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, str]]:
    """``{diffusers weight name: (lora_A key, lora_B key)}`` of a PEFT LoRA state dict on an original-layout Wan model.

    PEFT names the adapted ``blocks.0.self_attn.q`` as ``base_model.model.blocks.0.self_attn.q.lora_A.weight``
    (LongLive wraps ``generator.model``); wrapper segments, a ``model.`` prefix and an adapter name
    (``lora_A.default.weight``) are tolerated. Diffusers-layout LoRAs (``attn1.to_q``) map to themselves.

    Raises:
        CheckpointConversionError: a ``lora_A`` without its ``lora_B`` (or the reverse), or keys that are neither.
    """
    modules: dict[str, dict[str, str]] = {}
    others = []
    for key in lora:
        name = unwrap_key(key).removeprefix(PEFT_PREFIX).removeprefix("model.").removeprefix("transformer.")
        for part in ("lora_A", "lora_B"):
            marker = f".{part}."
            if marker in name and name.endswith(".weight"):
                module = name.split(marker)[0]
                modules.setdefault(module, {})[part] = key
                break
        else:
            others.append(key)
    if others:
        raise CheckpointConversionError(
            f"The LoRA file has keys that are neither `lora_A` nor `lora_B` weights: {others[:MAX_LISTED]} (DoRA "
            "magnitudes and biases are not supported)."
        )
    unpaired = sorted(module for module, parts in modules.items() if len(parts) != 2)
    if unpaired:
        raise CheckpointConversionError(f"LoRA modules without both lora_A and lora_B: {unpaired[:MAX_LISTED]}.")
    weight_names = [f"{module}.weight" for module in modules]
    if state_dict_layout(weight_names) == "original":
        renamed = _original_renames(weight_names)
    else:
        renamed = {name: name for name in weight_names}
    return {
        new: (modules[old[: -len(".weight")]]["lora_A"], modules[old[: -len(".weight")]]["lora_B"])
        for new, old in renamed.items()
    }


def merge_lora(
    weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, alpha: float | None, dtype: torch.dtype | None
) -> torch.Tensor:
    """``W + alpha / r * B @ A``, computed in float32, returned in ``dtype`` (default: ``weight``'s).

    Args:
        weight: ``(out, in)`` base weight.
        lora_a: ``(r, in)``.
        lora_b: ``(out, r)``.
        alpha: LoRA alpha; ``None`` means alpha = r (scale 1).
    """
    rank = lora_a.shape[0]
    if (
        lora_a.ndim != 2
        or lora_b.ndim != 2
        or lora_b.shape[1] != rank
        or (lora_b.shape[0], lora_a.shape[1]) != tuple(weight.shape)
    ):
        raise CheckpointConversionError(
            f"LoRA shapes A {tuple(lora_a.shape)} and B {tuple(lora_b.shape)} do not fit the weight "
            f"{tuple(weight.shape)} (expected A (r, in) and B (out, r))."
        )
    scale = 1.0 if alpha is None else float(alpha) / rank
    merged = weight.float() + scale * (lora_b.float() @ lora_a.float())
    return merged.to(dtype or weight.dtype)
