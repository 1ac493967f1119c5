"""The converted pipeline's model card (README.md): Hub metadata, the loading calls that work, stored settings."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..hub import HUB_PIPELINE_MODULE
from ..settings import CONFIG_KEYS

if TYPE_CHECKING:
    from .formats import StudentFormat
    from .result import ConversionResult

__all__ = ["REPO_PLACEHOLDER", "model_card"]

# The card's code uses this in place of the repository id (the converter does not know where it will be uploaded).
REPO_PLACEHOLDER = "path/or/hub-id/of/this/model"

_SETTING_DOCS = {
    "timesteps": "denoising timesteps per chunk (model scale)",
    "shift": "scheduler shift",
    "context_noise": "context noise (timestep of the cache pass)",
    "chunk_size": "chunk size (latent frames)",
    "independent_first_frame": "independent first frame",
    "first_chunk_timesteps": "timesteps of the first chunk",
    "attention_window": "attention window (latent frames, sink included)",
    "sink_frames": "sink frames",
    "kv_cache_policy": "KV cache policy",
    "context_frames": "context frames re-encoded per chunk",
    "kv_cache_attention_bias": "attention bias on cached frames (factor)",
    "rope_positions": "temporal RoPE positions of cached keys",
    "sink_update": "sink update",
    "sink_decay": "decay of the EMA sink",
    "keep_first_frame": "first latent frame kept as the recompute anchor",
}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _value(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.10g}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return str(value)


def _literal(value) -> str:
    """``value`` as Python source for the card's spelled-out call (strings quoted, ``True``, ``None``)."""
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    return _value(value) if isinstance(value, float) else repr(value)


# Where a stored setting lives: the chunking in the transformer config, the shift in the scheduler config, the rest
# in the pipeline config (model_index.json).
_STORED_IN = {"chunk_size": "transformer config", "independent_first_frame": "transformer config"}
_STORED_IN["shift"] = "scheduler config"


def model_card(
    result: ConversionResult,
    *,
    row: StudentFormat,
    checkpoint: Path,
    lora_file: str | os.PathLike | None,
    base_model: str | None,
    dtype: torch.dtype | None,
) -> str:
    """README.md: YAML front matter, install and the exact loading calls, sampling settings, provenance, license."""
    from .. import __version__

    tags = ["fastgen-diffusers", "text-to-video", "video-generation", "causal", "autoregressive", "wan", row.name]
    front_matter = "\n".join(
        [
            "---",
            "library_name: diffusers",
            "pipeline_tag: text-to-video",
            *([f"base_model: {json.dumps(base_model)}"] if base_model else []),
            "tags:",
            *(f"- {tag}" for tag in tags),
            # The weights carry the source checkpoint's license and the base model's (the card's License section).
            "license: other",
            f"license_name: {row.name}-source-checkpoint",
            f"license_link: https://github.com/{row.project}",
            "---",
        ]
    )
    base_source = (
        f"[`{base_model}`](https://huggingface.co/{base_model})"
        if base_model
        else "a local Wan base pipeline (add its Hub id as `base_model` above)"
    )
    settings = result.sampling.as_dict()
    summary = result.sampling.rollout_settings().card_words()  # the policy's words (settings/policies.py)
    rows = "\n".join(
        f"| {_SETTING_DOCS[key]} | `{key}` | {_value(value)} | "
        + (
            _STORED_IN.get(key, "pipeline config")
            if key in result.pipeline_settings
            else "`sampling.json` (policy pending)"
        )
        + " |"
        for key, value in settings.items()
    )
    defaults = ", ".join(
        f"{key}={_literal(settings[key])}"
        for key in CONFIG_KEYS  # the stored settings a `pipe(...)` call takes, in the settings' order
        if key in result.pipeline_settings and settings[key] is not None
    )
    pending_note = ""
    if any(key not in result.pipeline_settings for key in settings):
        pending_note = (
            "\nSettings marked `sampling.json` are recorded for a sampling policy this version of the pipeline does "
            "not run yet;\nthey are not applied.\n"
        )
    lora = ""
    if result.lora == "merged":
        lora = f"\n| LoRA | `{Path(lora_file).name}` merged (W + alpha/r B A in float32) |"
    elif result.lora == "kept":
        lora = f"\n| LoRA | `{Path(lora_file).name}` kept as `pytorch_lora_weights.safetensors` |"
    lora_usage = ""
    if result.lora == "kept":
        lora_usage = (
            "\nThe LoRA is stored next to the pipeline; load it with `pipe.load_lora_weights("
            f'"{REPO_PLACEHOLDER}")` (diffusers naming, alpha folded into `lora_B`).\n'
        )
    return f"""{front_matter}

# {row.title}: causal Wan student for diffusers

A few-step, chunk-by-chunk (autoregressive, KV-cached) Wan text-to-video model converted from a {row.title}
checkpoint ([{row.project}](https://github.com/{row.project})) with
[fastgen-diffusers](https://pypi.org/project/fastgen-diffusers/). The text encoder, tokenizer, VAE and transformer
config come from {base_source}.

## Install

```bash
pip install fastgen-diffusers
```

## Usage

```python
import torch
from diffusers import AutoencoderKLWan, DiffusionPipeline
from diffusers.utils import export_to_video

vae = AutoencoderKLWan.from_pretrained("{REPO_PLACEHOLDER}", subfolder="vae", dtype=torch.float32)
pipe = DiffusionPipeline.from_pretrained("{REPO_PLACEHOLDER}", vae=vae, trust_remote_code=True, dtype=torch.bfloat16)
pipe.to("cuda")
video = pipe("A red fox runs through fresh snow, cinematic lighting").frames[0]
export_to_video(video, "fox.mp4", fps=16)
```

`trust_remote_code=True` is required by diffusers for any pipeline class outside its package: it lets diffusers
import `{HUB_PIPELINE_MODULE}.py`, a one-line file that imports the class from the installed fastgen-diffusers
package (no model code is shipped). The VAE stays in float32, as diffusers' Wan examples and the fastgen-diffusers
CLI load it. Without remote code, load the class directly:

```python
import torch
from diffusers import AutoencoderKLWan
from fastgen_diffusers import WanCausalPipeline

vae = AutoencoderKLWan.from_pretrained("{REPO_PLACEHOLDER}", subfolder="vae", dtype=torch.float32)
pipe = WanCausalPipeline.from_pretrained("{REPO_PLACEHOLDER}", vae=vae, dtype=torch.bfloat16)
```
{lora_usage}
`pipe(prompt)` samples with the settings below: {summary} Every one can be overridden per call
(`pipe(prompt, {defaults})` spells out the stored defaults).

## Sampling settings ({row.name})

| setting | name | value | stored in |
|---|---|---|---|
{rows}
{pending_note}
## Source checkpoint

| | |
|---|---|
| project | [{row.project}](https://github.com/{row.project}) |
| file | `{checkpoint.name}` |
| sha256 | `{_sha256(checkpoint)}` |
| detected | {result.description} |
| converted weights | `{result.copy}` |{lora}
| dtype | {str(dtype).removeprefix("torch.") if dtype is not None else "as stored in the checkpoint"} |
| converter | fastgen-diffusers {__version__} |

## License

{row.license_note} Set the `license` field of this card accordingly.
"""
