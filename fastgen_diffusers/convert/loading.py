"""Reading checkpoint files safely and telling which released student a loaded checkpoint is.

Files are read with ``torch.load(weights_only=True)`` (memory-mapped for zip checkpoints) or lazily with safetensors:
a pickle that holds anything but tensors and plain containers is refused and nothing in it runs. An empty, truncated
or foreign file is named for what it is, in one line.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .formats import FORMATS, STUDENT_FORMATS, CheckpointFacts, get_format
from .mapping import CheckpointConversionError, has_wrapper_segment, state_dict_layout, strip_key

__all__ = [
    "DetectedCheckpoint",
    "LazySafetensors",
    "UnsafeCheckpointError",
    "detect_format",
    "load_checkpoint_safely",
    "load_lora_state_dict",
]


class UnsafeCheckpointError(CheckpointConversionError):
    """A pickle holds objects other than tensors and plain containers; it was refused without running it."""


class LazySafetensors(Mapping):
    """A read-only ``{name: tensor}`` view of a safetensors file; a tensor is read only when it is looked up.

    Shapes and dtypes come from the header (:meth:`shape`, :meth:`dtype`), so a converter can plan and validate a
    14B file without reading it, then stream its tensors into shards one at a time.
    """

    def __init__(self, path: str | os.PathLike):
        from safetensors import safe_open

        self.path = str(path)
        self._handle = safe_open(self.path, framework="pt", device="cpu")
        self._keys = list(self._handle.keys())

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keys:
            raise KeyError(key)
        return self._handle.get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handle.get_slice(key).get_shape())

    def dtype(self, key: str) -> str:
        return self._handle.get_slice(key).get_dtype()


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _looks_like_safetensors(head: bytes, size: int) -> bool:
    """A safetensors file starts with the little-endian u64 length of its JSON header, then ``{``."""
    return len(head) > 8 and head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") < size


def _what_it_is(head: bytes) -> str:
    """A guess at a non-checkpoint file's kind from its first bytes."""
    stripped = head.lstrip()
    if stripped[:1] == b"<":
        return "an HTML/XML document (a download error page?)"
    if stripped[:1] in (b"{", b"["):
        return "a JSON/text file"
    if head[:4] == b"\x89HDF":
        return "an HDF5 file"
    if head[:7] == b"version":
        return "a Git LFS pointer (the real file was not downloaded: run `git lfs pull`)"
    try:
        head.decode("utf-8")
        return "a text file"
    except UnicodeDecodeError:
        return "binary data of an unknown kind"


def load_checkpoint_safely(path: str | os.PathLike) -> Any:
    """Load a checkpoint without running code from it: safetensors (lazily), or ``torch.load(weights_only=True)``.

    Raises:
        FileNotFoundError: ``path`` is not a file.
        CheckpointConversionError: the file is empty, truncated, or not a PyTorch/safetensors checkpoint.
        UnsafeCheckpointError: the pickle references anything but tensors and plain containers (a class, a function,
            ``__reduce__`` payloads); the unpickler stops at the first such reference, so nothing in it ran.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Checkpoint {str(path)!r} does not exist or is not a file.")
    size = path.stat().st_size
    if size == 0:
        raise CheckpointConversionError(f"Checkpoint {str(path)!r} is empty (0 bytes): the download or copy failed.")
    with path.open("rb") as handle:
        head = handle.read(64)
    if path.suffix == ".safetensors" or _looks_like_safetensors(head, size):
        try:
            return LazySafetensors(path)
        except Exception as error:  # safetensors raises its own SafetensorError
            raise CheckpointConversionError(
                f"Checkpoint {str(path)!r} ({size} bytes) is not a readable safetensors file (truncated or "
                f"corrupt): {_first_line(error)}"
            ) from None
    is_zip = zipfile.is_zipfile(path)
    if head[:2] == b"PK" and not is_zip:
        raise CheckpointConversionError(
            f"Checkpoint {str(path)!r} ({size} bytes) is a truncated or corrupt zip archive (a torch.save file cut "
            "short?): its central directory is missing."
        )
    if not is_zip and head[:1] != b"\x80":
        raise CheckpointConversionError(
            f"Checkpoint {str(path)!r} is not a PyTorch checkpoint (neither a torch.save zip archive nor a pickle): "
            f"it looks like {_what_it_is(head)}."
        )
    try:
        # mmap keeps multi-GB zip checkpoints out of RAM until their tensors are used; legacy pickles cannot mmap.
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=is_zip)
        except RuntimeError as error:
            if not is_zip or "mmap" not in str(error).lower():
                raise
            return torch.load(path, map_location="cpu", weights_only=True)  # a zip torch cannot map: read it
    except pickle.UnpicklingError as error:
        if "weights only load failed" not in str(error).lower() or "truncated" in str(error).lower():
            raise CheckpointConversionError(
                f"Checkpoint {str(path)!r} ({size} bytes) is truncated or corrupt: {_first_line(error)}"
            ) from None
        raise UnsafeCheckpointError(
            f"Refused to load {str(path)!r}: its pickle holds objects other than tensors and plain containers "
            f"(dict, list, tuple, str, numbers), so it is not a plain weights file. Nothing in it was executed. "
            f"torch says: {_first_line(error)} If you trust the file, load it yourself in an isolated environment "
            f"and save only its state dicts (e.g. `torch.save({{'generator_ema': ckpt['generator_ema']}}, "
            f"'weights.pt')` or safetensors), then convert that."
        ) from None
    except (EOFError, RuntimeError, ValueError) as error:
        raise CheckpointConversionError(
            f"Checkpoint {str(path)!r} ({size} bytes) is truncated or corrupt: {_first_line(error)}"
        ) from None


def load_lora_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The PEFT LoRA state dict of a file: a plain one, or LongLive's ``{"generator_lora": ...}``."""
    loaded = load_checkpoint_safely(path)
    if isinstance(loaded, Mapping) and _is_state_dict(loaded.get("generator_lora")):
        loaded = loaded["generator_lora"]
    if not _is_state_dict(loaded) or not any(".lora_A." in key for key in loaded):
        keys = list(loaded)[:5] if isinstance(loaded, Mapping) else type(loaded).__name__
        raise CheckpointConversionError(
            f"--lora {str(path)!r} is not a PEFT LoRA state dict (keys `...lora_A.weight` / `...lora_B.weight`, "
            f"optionally under 'generator_lora'); it has {keys}."
        )
    return dict(loaded.items())


@dataclass
class DetectedCheckpoint:
    """What :func:`detect_format` found in a loaded checkpoint.

    Attributes:
        format: The format table row (``"self-forcing"``, ``"longlive"``, ...).
        copies: Candidate weight copies by name (``generator_ema``, ``generator``, ``net``, ``ema``, ...).
        ema_copies: Names in ``copies`` that are EMA weights.
        description: One line saying what was found and why this format (shown by the CLI).
    """

    format: str
    copies: dict[str, Mapping[str, torch.Tensor]]
    ema_copies: tuple[str, ...]
    description: str

    def select(self, ema: bool | str | None = None) -> str:
        """Name of the copy to convert: ``ema=None`` takes what the project's own loader takes (the EMA copy when
        there is exactly one, except for LongLive and StreamDiffusionV2), ``True`` requires an EMA copy, ``False``
        the regular one, a string names the copy."""
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
            ema = bool(self.ema_copies) and (get_format(self.format).prefer_ema or not regular)
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


def _is_lazy_or_state_dict(value: Any) -> bool:
    return isinstance(value, LazySafetensors) or _is_state_dict(value)


def _describe_keys(mapping: Mapping) -> str:
    keys = list(mapping)
    shown = ", ".join(repr(k) for k in keys[:10])
    return f"[{shown}{', ...' if len(keys) > 10 else ''}]"


def _containers(checkpoint: Mapping) -> tuple[str, dict[str, Mapping], tuple[str, ...], str]:
    """``(kind, copies, ema_copies, what)`` of a loaded checkpoint's structure."""
    generators = [name for name in ("generator_ema", "generator") if _is_state_dict(checkpoint.get(name))]
    if generators:
        ema = tuple(name for name in generators if name == "generator_ema")
        return "generator", {name: checkpoint[name] for name in generators}, ema, f"weight copies {generators}"
    if _is_state_dict(checkpoint.get("state_dict")):
        return "state_dict", {"state_dict": checkpoint["state_dict"]}, (), "weights under 'state_dict'"
    model = checkpoint.get("model")
    if _is_state_dict(model):
        return "model", {"model": model}, (), "weights under 'model'"
    if isinstance(model, Mapping) and any(_is_state_dict(v) for v in model.values()):
        names = [name for name, value in model.items() if _is_state_dict(value)]
        ema = tuple(name for name in names if name.startswith("ema"))
        selectable = [name for name in names if name == "net" or name in ema]
        if not selectable:
            raise CheckpointConversionError(
                f"FastGen checkpoint has no 'net' or 'ema*' weights under 'model'; it has {names}."
            )
        skipped = [name for name in names if name not in selectable]
        what = f"weight copies {selectable}" + (f" (ignoring training-only {skipped})" if skipped else "")
        return "fastgen", {name: model[name] for name in selectable}, ema, what
    if _is_lazy_or_state_dict(checkpoint):
        return "flat", {"state_dict": checkpoint}, (), "no EMA copy"
    raise CheckpointConversionError(
        "Unrecognised checkpoint: expected {'generator_ema': state_dict, 'generator': state_dict} "
        "(Self-Forcing family), {'model': state_dict}, {'state_dict': state_dict}, {'model': {'net': ..., 'ema': "
        f"...}}}} (FastGen) or a flat state dict of tensors, got top-level keys {_describe_keys(checkpoint)}."
    )


_CONTAINER_NAMES = {
    "generator": "a {'generator', 'generator_ema'} checkpoint",
    "state_dict": "a {'state_dict': ...} checkpoint",
    "model": "a {'model': state_dict} checkpoint",
    "fastgen": "a {'model': {'net', 'ema'}} checkpoint",
    "flat": "a flat state dict",
}


def _facts(kind: str, weights: Mapping, path: str | os.PathLike | None) -> CheckpointFacts:
    keys = list(weights)
    layout = state_dict_layout(keys)
    stripped = [strip_key(key) for key in keys]
    blocks = {key.split(".")[1] for key in stripped if key.startswith("blocks.") and key.count(".") > 1}
    dim = 0
    probe = next(
        (key for key in keys if strip_key(key) in ("blocks.0.self_attn.q.weight", "blocks.0.attn1.to_q.weight")), None
    )
    if probe is not None:
        dim = weights.shape(probe)[0] if isinstance(weights, LazySafetensors) else weights[probe].shape[0]
    name = ""
    if path is not None:
        path = Path(path)
        name = f"{path.parent.name}/{path.name}".lower()
    unwrapped = [key for key in keys if not has_wrapper_segment(key)]
    return CheckpointFacts(
        path=name,
        container=kind,
        layout=layout,
        fsdp_wrapped=len(unwrapped) < len(keys),
        model_prefix=all(key.startswith(("model.", "transformer.")) for key in unwrapped or keys),
        num_layers=len(blocks),
        dim=dim,
        safetensors=isinstance(weights, LazySafetensors),
    )


def detect_format(checkpoint: Any, format: str = "auto", path: str | os.PathLike | None = None) -> DetectedCheckpoint:
    """Find the weight copies of a loaded checkpoint and the row of the format table it belongs to.

    With ``format="auto"`` the first row whose detector recognises the file (its release name, container or key
    layout) wins; containers shared by several projects without a telling name fall back to Self-Forcing, and the
    description says so. An explicit ``format`` is checked against the containers that project saves.

    Args:
        checkpoint: What :func:`load_checkpoint_safely` returned.
        format: ``"auto"`` or a row name (see ``FORMATS``).
        path: The checkpoint path, used as a hint (release file names).

    Raises:
        CheckpointConversionError: the structure is unknown, or it contradicts an explicit ``format``.
    """
    if format not in FORMATS:
        raise ValueError(f"`format` must be one of {FORMATS}, got {format!r}.")
    if not isinstance(checkpoint, Mapping):
        raise CheckpointConversionError(
            f"Expected a checkpoint dict ({{'generator_ema', 'generator'}}, {{'model': ...}} or a state dict), got "
            f"{type(checkpoint).__name__}."
        )
    kind, copies, ema_copies, what = _containers(checkpoint)
    facts = _facts(kind, next(iter(copies.values())), path)
    found = f"{_CONTAINER_NAMES[kind]} ({facts.layout} Wan keys, {what}"
    if facts.fsdp_wrapped:
        found += ", FSDP/compile wrapper segments in its keys (stripped)"
    if facts.layout == "original" and not facts.model_prefix:
        found += ", keys without the 'model.' prefix"
    found += ")"
    if format == "auto":
        for row in STUDENT_FORMATS:
            evidence = row.detector(facts)
            if evidence is not None:
                return DetectedCheckpoint(row.name, copies, ema_copies, f"{row.title}: {found}; {evidence}")
        if facts.layout == "diffusers":
            return DetectedCheckpoint("fastgen", copies, ema_copies, f"FastGen: {found}; diffusers key names")
        candidates = [row.name for row in STUDENT_FORMATS if kind in row.containers and row.name != "self-forcing"]
        return DetectedCheckpoint(
            "self-forcing",
            copies,
            ema_copies,
            f"Self-Forcing: {found}; no release name or layout tells the project apart, so Self-Forcing's sampling "
            "settings apply: "
            f"pass --format to pick another of {candidates}",
        )
    row = get_format(format)
    if kind not in row.containers:
        raise CheckpointConversionError(
            f"--format {format} expects {' or '.join(_CONTAINER_NAMES[c] for c in row.containers)}, but found {found}."
        )
    return DetectedCheckpoint(format, copies, ema_copies, f"{row.title}: {found}")
