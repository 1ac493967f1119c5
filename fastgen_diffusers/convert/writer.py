"""Writing a converted pipeline directory: transformer shards streamed tensor by tensor, base components copied.

Peak memory stays near one copy of the transformer weights: the source is memory-mapped (zip ``.pt``) or read
lazily (safetensors), and each output tensor is made (renamed, LoRA-merged, cast) only when it is written, straight
into its shard file, and released before the next one. The text encoder, tokenizer and VAE are copied as files, never
loaded. Everything is written to a temporary directory beside the output and renamed at the end.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import torch
from huggingface_hub import split_torch_state_dict_into_shards

from .mapping import CheckpointConversionError

__all__ = [
    "SAFETENSORS_DTYPES",
    "atomic_output_dir",
    "base_component_entries",
    "copy_base_components",
    "parse_size",
    "write_sharded_safetensors",
]

WEIGHTS_PATTERN = "diffusion_pytorch_model{suffix}.safetensors"
WEIGHTS_INDEX = "diffusion_pytorch_model.safetensors.index.json"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: int | str) -> int:
    """Bytes of ``"5GB"``, ``"512MiB"`` or an int."""
    if isinstance(size, int):
        value = size
    else:
        text = str(size).strip().upper()
        number = text.rstrip("KMGTIB")
        unit = text[len(number) :]
        try:
            value = int(float(number) * _UNITS[unit])
        except (KeyError, ValueError, OverflowError):  # an unknown unit, not a number, nan or inf
            raise ValueError(
                f"`max_shard_size` must be bytes or a size like '5GB' / '512MiB', got {size!r}."
            ) from None
    if value <= 0:
        raise ValueError(f"`max_shard_size` must be positive, got {size!r}.")
    return value


@contextlib.contextmanager
def atomic_output_dir(output: Path) -> Iterator[Path]:
    """A fresh temporary directory beside ``output``, renamed to ``output`` when the block succeeds.

    On any error or interrupt the temporary directory is removed, so nothing that looks like a finished pipeline is
    left, and a rerun starts clean. ``output`` must not exist or be an empty directory (checked before any work).
    """
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise FileExistsError(f"--output {str(output)!r} exists and is not an empty directory; pick a new one.")
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-", dir=output.parent))
    try:
        yield staging
        if output.exists():
            output.rmdir()  # empty, checked above
        os.replace(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


# The floating dtypes a shard can hold, by safetensors code (float8: the two formats safetensors names).
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_SAFETENSORS_CODES = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}


def _write_safetensors_file(
    path: Path,
    names: list[str],
    shapes: Mapping[str, tuple[torch.Size, torch.dtype]],
    make_tensor: Callable[[str], torch.Tensor],
) -> None:
    """One safetensors file written tensor by tensor: the header is planned from ``shapes``, then each tensor's bytes
    go straight from ``make_tensor(name)`` to the file (no serialization buffer), so one tensor is in memory."""
    header, offset = {}, 0
    for name in names:
        shape, dtype = shapes[name]
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {
            "dtype": _SAFETENSORS_CODES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header["__metadata__"] = {"format": "pt"}
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with path.open("wb") as handle:
        handle.write(len(blob).to_bytes(8, "little"))
        handle.write(blob)
        for name in names:
            tensor = make_tensor(name)
            if tuple(tensor.shape) != tuple(shapes[name][0]) or tensor.dtype != shapes[name][1]:
                raise AssertionError(f"{name}: made {tuple(tensor.shape)} {tensor.dtype}, planned {shapes[name]}")
            handle.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
            del tensor


def write_sharded_safetensors(
    directory: Path,
    shapes: Mapping[str, tuple[torch.Size, torch.dtype]],
    make_tensor: Callable[[str], torch.Tensor],
    max_shard_size: int,
) -> list[str]:
    """Write ``{name: make_tensor(name)}`` as diffusers' (sharded) safetensors, one tensor in memory at a time.

    Args:
        directory: The transformer folder.
        shapes: ``{name: (shape, dtype)}`` of every output tensor (planned before any tensor is made).
        make_tensor: Builds one output tensor; called once per name, in file order.
        max_shard_size: Shard limit in bytes (diffusers' naming: ``diffusion_pytorch_model-00001-of-0000N``).

    Returns:
        The shard file names.
    """
    meta = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in shapes.items()}
    split = split_torch_state_dict_into_shards(meta, filename_pattern=WEIGHTS_PATTERN, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        _write_safetensors_file(directory / filename, sorted(names), shapes, make_tensor)
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (directory / WEIGHTS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return list(split.filename_to_tensors)


# Components of a T2V base that the causal pipeline keeps as they are (copied file by file).
COPIED_COMPONENTS = ("tokenizer", "text_encoder", "vae")


def resolve_base(base: str | os.PathLike) -> Path:
    """A local directory of ``base``: itself, or a Hub snapshot of what the conversion reads (no transformer
    weights)."""
    path = Path(base)
    if path.is_dir():
        if not (path / "model_index.json").is_file():
            raise CheckpointConversionError(
                f"--base {str(base)!r} is not a diffusers pipeline directory (no model_index.json)."
            )
        return path
    looks_local = path.is_absolute() or str(base).startswith((".", "~"))
    if path.exists() or looks_local or str(base).count("/") != 1:
        raise CheckpointConversionError(
            f"--base {str(base)!r} is neither a diffusers pipeline directory nor a Hub id like "
            "'Wan-AI/Wan2.1-T2V-1.3B-Diffusers'" + (" (no such directory)." if not path.exists() else ".")
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = ["model_index.json", "scheduler/*", "transformer/config.json", *(f"{c}/*" for c in COPIED_COMPONENTS)]
    try:
        return Path(snapshot_download(str(base), allow_patterns=patterns))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as error:
        raise CheckpointConversionError(
            f"--base {str(base)!r} could not be fetched from the Hub ({type(error).__name__}); when offline, fetch it "
            f"first with `huggingface-cli download {base} --include 'model_index.json' 'scheduler/*' "
            "'transformer/config.json' 'tokenizer/*' 'text_encoder/*' 'vae/*'`, or pass a local directory."
        ) from None


def base_component_entries(base: Path) -> dict[str, list]:
    """The ``model_index.json`` entries of ``base``'s tokenizer, text encoder and VAE, each checked to have its folder
    (run before anything is written)."""
    try:
        index = json.loads((base / "model_index.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise CheckpointConversionError(f"--base {str(base)!r}: model_index.json cannot be read ({error}).") from None
    entries = {}
    for name in COPIED_COMPONENTS:
        entry = index.get(name)
        if not isinstance(entry, list) or len(entry) != 2 or entry[0] is None:
            if name == "vae":
                raise CheckpointConversionError(f"--base {str(base)!r} has no VAE in its model_index.json.")
            entries[name] = [None, None]
            continue
        if not (base / name).is_dir():
            raise CheckpointConversionError(f"--base {str(base)!r} lists `{name}` but has no {name}/ folder.")
        entries[name] = list(entry)
    return entries


def copy_base_components(base: Path, staging: Path) -> dict[str, list]:
    """Copy the tokenizer, text encoder and VAE folders of ``base``; returns their ``model_index.json`` entries."""
    entries = base_component_entries(base)
    for name, entry in entries.items():
        if entry[0] is not None:
            shutil.copytree(base / name, staging / name)  # follows Hub-cache symlinks to the blobs
    return entries
