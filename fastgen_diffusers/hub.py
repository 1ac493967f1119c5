"""``diffusers.DiffusionPipeline.from_pretrained(dir)`` for causal pipeline directories (converted or saved).

diffusers 0.42 resolves a pipeline class outside its own package only through a *custom pipeline file*: when
``model_index.json`` has ``"_class_name": [module, ClassName]`` and ``<module>.py`` sits at the repository root,
``DiffusionPipeline.from_pretrained`` imports that file (only with ``trust_remote_code=True``) and takes ``ClassName``
from it (``_resolve_custom_pipeline_and_cls`` / ``_get_custom_pipeline_class``). A component outside diffusers and
transformers must be a file in its folder on the Hub (``<component>/<library>.py``, checked by
``_get_custom_components_and_folders``), and when the caller passes the component itself its library must be
importable (``_get_library_or_raise``).

So a causal pipeline directory is written in this *hub form*:

- ``model_index.json``: ``"_class_name": ["pipeline_fastgen_diffusers", "WanCausalPipeline"]`` and
  ``"transformer": ["fastgen_diffusers", "WanCausalTransformer3DModel"]``;
- ``pipeline_fastgen_diffusers.py`` and ``transformer/fastgen_diffusers.py``: one import line each, from the
  installed ``fastgen_diffusers`` package (no model code is shipped, so the directory runs the installed version).

``DiffusionPipeline.from_pretrained(dir, trust_remote_code=True)`` then returns the causal pipeline class itself.
The causal pipelines read the same directory without running any file: :class:`HubPipelineMixin` reads
``_class_name`` back as the plain class name (so diffusers takes the calling class and downloads no code), and they
pass their transformer themselves (library ``fastgen_diffusers`` is the imported package).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = [
    "HUB_COMPONENT_LIBRARY",
    "HUB_PIPELINE_MODULE",
    "HubPipelineMixin",
    "from_hub_model_index",
    "make_hub_loadable",
    "to_hub_model_index",
]

HUB_PIPELINE_MODULE = "pipeline_fastgen_diffusers"
HUB_COMPONENT_LIBRARY = "fastgen_diffusers"
MODEL_INDEX = "model_index.json"

_SHIM = '''"""Written by fastgen-diffusers so that diffusers can load this directory: it imports {names} from the
installed fastgen-diffusers package (`pip install fastgen-diffusers`) and ships no model code."""

try:
    from fastgen_diffusers import {names}  # noqa: F401
except ImportError as error:
    raise ImportError("This model needs the fastgen-diffusers package: `pip install fastgen-diffusers`.") from error
'''


def _is_ours(entry: Any) -> bool:
    return (
        isinstance(entry, (list, tuple))
        and len(entry) == 2
        and isinstance(entry[0], str)
        and (entry[0] == HUB_COMPONENT_LIBRARY or entry[0].startswith(HUB_COMPONENT_LIBRARY + "."))
    )


def to_hub_model_index(index: dict[str, Any]) -> dict[str, Any]:
    """``index`` (a ``model_index.json`` dict) in hub form: the pipeline named through its loader file, our components
    under the library ``fastgen_diffusers``, without the ``_name_or_path`` of the directory it was loaded from."""
    hub = {key: value for key, value in index.items() if key != "_name_or_path"}  # a local path must not travel
    class_name = hub["_class_name"]
    if isinstance(class_name, (list, tuple)):
        class_name = class_name[1]
    hub["_class_name"] = [HUB_PIPELINE_MODULE, class_name]
    for name, entry in index.items():
        if not name.startswith("_") and _is_ours(entry):
            hub[name] = [HUB_COMPONENT_LIBRARY, entry[1]]
    return hub


def from_hub_model_index(index: dict[str, Any]) -> dict[str, Any]:
    """The inverse for the causal pipeline classes: ``_class_name`` as the plain class name, so diffusers uses the
    calling class and neither downloads nor runs the loader file."""
    class_name = index.get("_class_name")
    if isinstance(class_name, (list, tuple)) and len(class_name) == 2 and class_name[0] == HUB_PIPELINE_MODULE:
        return {**index, "_class_name": class_name[1]}
    return index


def make_hub_loadable(directory: str | os.PathLike) -> None:
    """Rewrite ``directory/model_index.json`` in hub form and write the loader files (idempotent)."""
    directory = Path(directory)
    index = json.loads((directory / MODEL_INDEX).read_text(encoding="utf-8"))
    hub = to_hub_model_index(index)
    (directory / MODEL_INDEX).write_text(json.dumps(hub, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (directory / f"{HUB_PIPELINE_MODULE}.py").write_text(_SHIM.format(names=hub["_class_name"][1]), encoding="utf-8")
    for name, entry in hub.items():
        if not name.startswith("_") and _is_ours(entry):
            (directory / name).mkdir(exist_ok=True)
            (directory / name / f"{HUB_COMPONENT_LIBRARY}.py").write_text(
                _SHIM.format(names=entry[1]), encoding="utf-8"
            )


class HubPipelineMixin:
    """Save hook and config reading of the causal pipelines (put it before ``DiffusionPipeline`` in the bases).

    ``save_pretrained`` writes ``model_index.json`` through ``save_config``; this mixin makes the saved directory hub
    form right there (before a ``push_to_hub`` upload). Reading a ``model_index.json`` through a causal class turns the
    hub form back into the plain class name.
    """

    def save_config(self, save_directory: str | os.PathLike, push_to_hub: bool = False, **kwargs) -> None:
        if push_to_hub:  # diffusers' own pipelines push from save_pretrained, after save_config
            raise ValueError(
                "Push a causal pipeline with `save_pretrained(..., push_to_hub=True)`, not `save_config`."
            )
        super().save_config(save_directory, **kwargs)
        make_hub_loadable(save_directory)

    @classmethod
    def _dict_from_json_file(cls, json_file: str | os.PathLike) -> dict[str, Any]:
        return from_hub_model_index(super()._dict_from_json_file(json_file))
