"""The call arguments the four pipelines share are documented once: a settings argument's entry in each ``__call__``
docstring is its settings value's help (what the CLI's ``--help`` shows), the other shared ones come from one table."""

from __future__ import annotations

import inspect
import re

import pytest

from fastgen_diffusers import (
    WanCausalImageToVideoPipeline,
    WanCausalPipeline,
    WanCausalVACEPipeline,
    WanCausalVideoToVideoPipeline,
)
from fastgen_diffusers.pipelines.rollout.call_docs import CALL_ARGUMENT_DOCS, shared_call_docs
from fastgen_diffusers.settings import CONFIG_KEYS, RolloutSettings, argument_names

PIPELINES = (WanCausalPipeline, WanCausalImageToVideoPipeline, WanCausalVACEPipeline, WanCausalVideoToVideoPipeline)


def entries(docstring: str) -> dict[str, str]:
    """The ``Args:`` entries of a docstring by name (one name per entry), their text unwrapped."""
    found, name = {}, None
    for line in docstring.splitlines():
        match = re.match(r"^ {12}(\w+) \(.*\):$", line)
        if match:
            name = match.group(1)
            found[name] = ""
        elif name and line.startswith(" " * 16):
            found[name] = (found[name] + " " + line.strip()).strip()
        else:
            name = None
    return found


@pytest.mark.parametrize("cls", PIPELINES, ids=lambda cls: cls.__name__)
def test_every_call_argument_is_documented_and_shared_ones_from_their_one_source(cls):
    docstring = cls.__call__.__doc__
    assert "{shared_args}" not in docstring
    parameters = list(inspect.signature(cls.__call__).parameters)[1:]
    documented = entries(docstring)
    for name in parameters:
        assert re.search(rf"^ {{12}}(.*[ ,])?{name}[ ,:(]", docstring, re.M), f"{cls.__name__}: `{name}` undocumented"
    for name in set(parameters) & set(argument_names()) & set(documented):
        if cls is WanCausalPipeline:  # text-to-video documents every shared argument from its source
            assert documented[name] == RolloutSettings.help_of(name), name
    t2v = entries(WanCausalPipeline.__call__.__doc__)
    for name, text in CALL_ARGUMENT_DOCS.items():
        assert t2v[name] == text, name


def test_an_argument_documented_nowhere_is_refused_at_definition():
    def call(self, prompt=None, not_documented_anywhere=None):
        """Args:
        {shared_args}
        """

    with pytest.raises(TypeError, match="documents no argument `not_documented_anywhere`"):
        shared_call_docs(call)


def test_the_stored_settings_are_documented_once_as_the_defaults_of_the_call():
    docstring = WanCausalPipeline.__doc__
    assert "{shared_args}" not in docstring
    for name in CONFIG_KEYS:
        assert re.search(rf"^ {{8}}{name} \(.*\):\n +Stored default of the call's `{name}`", docstring, re.M), name
