"""Video-to-video strength: diffusers' schedule trim, noising to the first kept step, per-chunk strength."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from diffusers import WanVideoToVideoPipeline

from fastgen_diffusers.pipelines.rollout.strength import (
    MotionAwareStrength,
    StrengthSchedule,
    first_kept_step,
    noise_to_strength,
)
from fastgen_diffusers.testing import tiny_scheduler


def _scheduler(num_steps: int = 4):
    scheduler = tiny_scheduler()
    scheduler.set_timesteps(sigmas=torch.linspace(1.0, 0.0, num_steps + 1)[:-1].tolist())
    return scheduler  # timesteps 1000, 937.5, 833.3, 625 (shift 5)


@pytest.mark.parametrize("num_steps", [1, 2, 4, 7])
@pytest.mark.parametrize("strength", [0.0, 0.1, 0.25, 0.3, 0.5, 0.6, 0.7, 0.75, 0.99, 1.0])
def test_trim_is_diffusers_get_timesteps(num_steps, strength):
    timesteps = torch.arange(num_steps, 0, -1).float()
    host = SimpleNamespace(scheduler=SimpleNamespace(order=1))
    kept, _ = WanVideoToVideoPipeline.get_timesteps(host, num_steps, timesteps, strength, "cpu")
    assert torch.equal(timesteps[first_kept_step(num_steps, strength) :], kept)


def test_strength_zero_returns_the_encoded_latents_and_no_step():
    scheduler = _scheduler()
    encoded, noise = torch.randn(2, 1, 16, 3, 4, 4).unbind(0)
    latents, begin = noise_to_strength(encoded, noise, scheduler.sigmas, 0.0)
    assert latents is encoded and begin == 4
    assert noise_to_strength(encoded, noise, scheduler.sigmas, 0.2)[1] == 4  # int(4 * 0.2) = 0 steps kept


def test_strength_one_is_the_text_to_video_start():
    scheduler = _scheduler()
    encoded, noise = torch.randn(2, 1, 16, 3, 4, 4).unbind(0)
    latents, begin = noise_to_strength(encoded, noise, scheduler.sigmas, 1.0)
    assert latents is noise and begin == 0
    # For a schedule starting at sigma 1 the blend formula gives the same tensor bit for bit.
    assert torch.equal((1.0 - scheduler.sigmas[0]) * encoded + scheduler.sigmas[0] * noise, noise)


@pytest.mark.parametrize(("strength", "begin"), [(0.5, 2), (0.6, 2), (0.75, 1), (0.25, 3)])
def test_intermediate_strength_noises_to_the_first_kept_sigma(strength, begin):
    scheduler = _scheduler()
    encoded, noise = torch.randn(2, 1, 16, 3, 4, 4).unbind(0)
    latents, first = noise_to_strength(encoded, noise, scheduler.sigmas, strength)
    assert first == begin
    sigma = scheduler.sigmas[begin]
    assert torch.equal(latents, (1.0 - sigma) * encoded + sigma * noise)
    # diffusers' flow-matching noising at that timestep is the same blend
    assert torch.equal(latents, scheduler.scale_noise(encoded, scheduler.timesteps[begin : begin + 1], noise))
    assert noise_to_strength(encoded, noise, scheduler.sigmas[:-1], strength)[1] == begin  # without the final 0


@pytest.mark.parametrize("strength", [-0.1, 1.5, float("nan"), True, "0.5", None])
def test_strength_outside_zero_one_is_refused(strength):
    with pytest.raises(ValueError, match="`strength` must be a number in \\[0, 1\\]"):
        StrengthSchedule(strength)
    with pytest.raises(ValueError, match="`strength` must be a number in \\[0, 1\\]"):
        noise_to_strength(torch.zeros(1), torch.zeros(1), torch.ones(2), strength)


def test_strength_per_chunk_from_a_number_a_callable_or_a_schedule():
    assert [StrengthSchedule(0.7).at(i) for i in range(3)] == [0.7] * 3
    assert [StrengthSchedule(lambda i: 1.0 - 0.25 * i).at(i) for i in range(3)] == [1.0, 0.75, 0.5]
    schedule = StrengthSchedule({0: 0.5, 2: 1.0, 5: 0.0})
    assert [schedule.at(i) for i in range(7)] == [0.5, 0.5, 1.0, 1.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize(
    ("strength", "message"),
    [
        ({}, "schedule is empty"),
        ({1: 0.5}, "must set chunk 0"),
        ({0: 0.5, -1: 0.5}, "keys must be chunk indices >= 0"),
        ({0: 0.5, 1.5: 0.5}, "keys must be chunk indices >= 0"),
        ({0: 0.5, 3: 2.0}, "`strength\\[3\\]` must be a number in \\[0, 1\\], got 2.0"),
    ],
)
def test_bad_strength_schedules_are_refused(strength, message):
    with pytest.raises(ValueError, match=message):
        StrengthSchedule(strength)


def test_callable_strength_is_checked_for_each_chunk():
    schedule = StrengthSchedule(lambda i: 0.5 * i)
    assert schedule.at(2) == 1.0
    with pytest.raises(ValueError, match="`strength\\(3\\)` must be a number in \\[0, 1\\], got 1.5"):
        schedule.at(3)


def _moving(num_frames: int, step: float, seed: int = 0) -> torch.Tensor:
    """(1, 3, f, 8, 8) frames in [-1, 1] whose consecutive frames differ by RMS ``step``."""
    base = torch.rand(1, 3, 1, 8, 8, generator=torch.Generator().manual_seed(seed)) * 0.5 - 0.25
    signs = torch.tensor([(-1.0) ** i for i in range(num_frames)]).view(1, 1, -1, 1, 1)
    return base + signs * step / 2


def test_motion_aware_strength_lowers_strength_on_fast_motion():
    controller = MotionAwareStrength()
    still = StrengthSchedule(controller)
    assert still.needs_frames
    values = [still.at(i, _moving(9 if i == 0 else 12, 0.0)) for i in range(6)]
    assert values[0] == pytest.approx(0.9 * 0.8 + 0.1 * 0.7) and controller.motion == 0.0
    assert values[-1] == pytest.approx(0.8, abs=1e-5)  # a still input converges to max_strength
    fast = controller.observe(_moving(12, 0.4))  # RMS 0.4 > motion_scale 0.2: full motion
    assert controller.motion == pytest.approx(1.0)
    assert fast == pytest.approx(0.9 * 0.6 + 0.1 * values[-1])
    half = MotionAwareStrength(smoothing=0.0)
    assert half.observe(_moving(9, 0.1)) == pytest.approx(0.8 - 0.2 * 0.5)  # RMS 0.1: half motion
    # the previous chunk's last frame counts: a jump at the chunk boundary is motion
    assert half.observe(_moving(4, 0.0, seed=1)) < 0.8
    half.reset()
    assert half.strength == 0.7 and half.motion == 0.0
    controller_schedule = StrengthSchedule(controller)
    controller_schedule.reset()  # a new video
    assert controller.strength == 0.7 and controller.motion == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_strength": 1.2}, "`max_strength` must be"),
        ({"sensitivity": 0.9}, "`sensitivity` must be in"),
        ({"motion_scale": 0.0}, "`motion_scale` must be > 0"),
        ({"smoothing": 1.0}, "`smoothing` must be in"),
    ],
)
def test_bad_motion_controller_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MotionAwareStrength(**kwargs)


def test_motion_aware_strength_needs_the_frames():
    with pytest.raises(ValueError, match="needs the chunk's pixel frames"):
        StrengthSchedule(MotionAwareStrength()).at(0)
