"""The documentation of the call arguments the four pipelines share, written once.

A pipeline's ``__call__`` docstring documents its own arguments and ends its ``Args:`` with the line
``{shared_args}``; [`shared_call_docs`] replaces that line with an entry for each remaining argument of the signature:
a settings argument's entry is its settings value's help ([`RolloutSettings.help_of`], what the CLI's ``--help``
shows), any other one's is [`CALL_ARGUMENT_DOCS`]'s. The type and default of each entry are read from the signature.
A pipeline class's docstring is filled the same way with its stored settings ([`stored_settings_docs`]).
"""

from __future__ import annotations

import inspect
import re
import textwrap
from collections.abc import Callable, Iterable
from typing import Any

from ...settings import CONFIG_KEYS, RolloutSettings, argument_names

PLACEHOLDER = "{shared_args}"
ENTRY_INDENT = " " * 12
CLASS_ENTRY_INDENT = " " * 8
LINE_WIDTH = 119

# The arguments every pipeline takes that are no setting, documented once.
CALL_ARGUMENT_DOCS = {
    "prompt": (
        "The prompt or prompts to guide the video generation. If not defined, pass `prompt_embeds` instead. A dict "
        '`{pixel_frame: prompt}` (keys include 0, e.g. `{0: "a cat", 48: "a dog"}`) switches prompts mid-video: each '
        "prompt takes effect at the first chunk starting at or after its frame (latent frame `s >= 1` starts at pixel "
        "frame `4s - 3`; 81 frames in chunks of 3 start at 0, 9, 21, 33, ...). The chunks before a switch are "
        "unchanged by it."
    ),
    "height": "Height in pixels of the generated video, a multiple of 16.",
    "width": "Width in pixels of the generated video, a multiple of 16.",
    "num_frames": "Number of pixel frames, of the form 4k+1 (81 frames are 21 latent frames: 7 chunks of 3).",
    "latents": (
        "Initial noise `(B, 16, (num_frames - 1) // 4 + 1, height // 8, width // 8)`; chunk `[s, e)` starts from "
        "`latents[:, :, s:e]`."
    ),
    "prompt_embeds": (
        "Pre-generated text embeddings `(B, L, text_dim)`, or a dict `{pixel_frame: embeddings}` like `prompt`."
    ),
    "negative_prompt": 'The prompt or prompts to avoid, used only when `guidance_scale > 1` (defaults to `""` then).',
    "chunk_size": "Latent frames per chunk; defaults to the transformer's `chunk_size` (the one it was trained with).",
    "generator": "RNG(s) for the initial noise, the scheduler's re-noising and the context noise.",
    "negative_prompt_embeds": "Pre-generated negative text embeddings `(B, L, text_dim)`.",
    "output_type": ('`"np"` (`(B, F, H, W, 3)` floats in [0, 1]), `"pil"`, `"pt"` (`(B, F, 3, H, W)`) or `"latent"`.'),
    "return_dict": "Whether to return a [`~pipelines.wan.pipeline_output.WanPipelineOutput`] instead of a tuple.",
    "attention_kwargs": "Passed to the transformer; `scale` sets the LoRA scale.",
    "callback_on_step_end": (
        "Called after every denoising step of every chunk as `callback_on_step_end(self, step, timestep, "
        'callback_kwargs)`. Per chunk, unlike diffusers\' one-sequence pipelines: `callback_kwargs["latents"]` is the '
        "chunk being denoised, `(B, C, F_chunk, H, W)`, not the whole video, and latents it returns replace that "
        "chunk's only; `timestep` is the chunk's current step; `step` counts over chunks x steps, so "
        "`self.num_timesteps` is the steps of all chunks (it grows chunk by chunk for an open-ended stream). Under "
        '`kv_cache_policy="rolling"` it runs once per window forward instead. Set `pipe._interrupt = True` in it to '
        "stop the rollout (the unfinished chunk is dropped)."
    ),
    "callback_on_step_end_tensor_inputs": (
        'Tensors given to `callback_on_step_end`, from `["latents", "prompt_embeds", "negative_prompt_embeds"]`.'
    ),
    "max_sequence_length": "Text tokens of the prompt encoding (padded or truncated to it).",
    "num_videos_per_prompt": (
        "Videos per prompt, as in diffusers: the prompts (and their embeddings) are repeated, so `latents` and a list "
        "of `generator`s cover `batch * num_videos_per_prompt` videos; conditioning inputs are shared."
    ),
    "settings": (
        "The call's settings as one value (sampling, cache, policy, prompt schedule); the flat arguments above "
        "override it where they differ from their defaults, and the pipeline's stored settings fill what neither "
        "sets."
    ),
}


def _split_types(annotation: str) -> list[str]:
    """The members of a ``A | B[C | D] | None`` annotation, split at the top-level ``|`` only."""
    parts, depth, current = [], 0, ""
    for char in annotation:
        if char in "[(":
            depth += 1
        elif char in "])":
            depth -= 1
        if char == "|" and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    return [*parts, current.strip()]


def _literal(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_literal(entry) for entry in value) + "]"
    return f'"{value}"' if isinstance(value, str) else repr(value)


def argument_entry(parameter: inspect.Parameter, text: str, indent: str = ENTRY_INDENT) -> str:
    """One ``Args:`` entry in diffusers' form: ``name (`type`, *optional*, defaults to `x`):`` and the wrapped text."""
    annotation = parameter.annotation
    if not isinstance(annotation, str):
        annotation = inspect.formatannotation(annotation)
    types = _split_types(annotation)
    words = [" or ".join(f"`{t}`" for t in types if t != "None")]
    if "None" in types:
        words.append("*optional*")
    if parameter.default is not inspect.Parameter.empty and parameter.default is not None:
        words.append(f"defaults to `{_literal(parameter.default)}`")
    text_indent = indent + " " * 4
    body = textwrap.fill(
        text, LINE_WIDTH, initial_indent=text_indent, subsequent_indent=text_indent, break_on_hyphens=False
    )
    return f"{indent}{parameter.name} ({', '.join(words)}):\n{body}"


def documented_names(docstring: str, indent: str = ENTRY_INDENT) -> set[str]:
    """The argument names a docstring's ``Args:`` entries name (``name (`type`):``, or ``a, b, c:``)."""
    names = set()
    for line in docstring.splitlines():
        if line.startswith(indent) and not line.startswith(indent + " "):
            names.update(re.findall(r"(\w+)(?= \(|,\s|:$)", line.strip()))
    return names


def shared_argument_text(name: str) -> str | None:
    """The documentation of the shared argument ``name``: its settings help, else [`CALL_ARGUMENT_DOCS`]'s."""
    if name in argument_names():
        return RolloutSettings.help_of(name)
    return CALL_ARGUMENT_DOCS.get(name)


def fill_arguments(
    owner: str, docstring: str, parameters: Iterable[inspect.Parameter], text_of: Callable, indent: str
) -> str:
    """``docstring`` with its ``{shared_args}`` line (at ``indent``) replaced by an entry for each of ``parameters``
    it does not document itself, with the text ``text_of(name)``; ``TypeError`` where that is ``None``."""
    if PLACEHOLDER not in docstring:
        raise TypeError(f"{owner}'s docstring has no `{PLACEHOLDER}` line for the shared arguments.")
    own = documented_names(docstring, indent)
    entries = []
    for parameter in parameters:
        if parameter.name in own:
            continue
        text = text_of(parameter.name)
        if text is None:
            raise TypeError(f"{owner} documents no argument `{parameter.name}`.")
        entries.append(argument_entry(parameter, text, indent))
    return docstring.replace(indent + PLACEHOLDER, "\n".join(entries))


def shared_call_docs(function: Callable) -> Callable:
    """Fill the ``{shared_args}`` line of ``function``'s docstring with the entries of every argument of its signature
    that the docstring does not document itself (see the module docstring); ``TypeError`` for an argument that is
    documented nowhere."""
    parameters = list(inspect.signature(function).parameters.values())[1:]
    function.__doc__ = fill_arguments(
        function.__qualname__, function.__doc__ or "", parameters, shared_argument_text, ENTRY_INDENT
    )
    return function


def stored_settings_docs(cls: type) -> type:
    """Fill the ``{shared_args}`` line of a pipeline class's docstring (its ``__init__`` arguments) with the entries
    of the stored settings (:data:`CONFIG_KEYS`, written by ``fastgen-diffusers convert``): each the default of the
    call argument of that name."""

    def text_of(name: str) -> str:
        return f"Stored default of the call's `{name}` (see `__call__`), used when a call leaves it out."

    parameters = [p for p in inspect.signature(cls.__init__).parameters.values() if p.name in CONFIG_KEYS]
    cls.__doc__ = fill_arguments(cls.__name__, cls.__doc__ or "", parameters, text_of, CLASS_ENTRY_INDENT)
    return cls
