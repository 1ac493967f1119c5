"""Outputs are bit-identical to the recording made before the settings values were introduced
(tests/data/settings_baseline/, see its README): every configuration of `settings_cases.CASES`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from settings_cases import CASES, THREADS, Pipes

RECORDING = Path(__file__).parent / "data" / "settings_baseline" / "outputs.safetensors"


@pytest.fixture(scope="module")
def pipes():
    threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    yield Pipes()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def recorded():
    return load_file(RECORDING)


def test_recording_covers_every_case(recorded):
    assert sorted(recorded) == sorted(CASES)


@torch.no_grad()
@pytest.mark.parametrize("name", list(CASES))
def test_output_is_bit_identical_to_the_recording(pipes, recorded, name):
    torch.set_num_threads(THREADS)
    assert torch.equal(CASES[name](pipes), recorded[name])
