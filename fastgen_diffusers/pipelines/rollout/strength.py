"""Video-to-video strength: how much of each input chunk is replaced by noise, and where its denoising starts.

diffusers' ``WanVideoToVideoPipeline`` keeps the last ``int(N * strength)`` of the ``N`` denoising steps and noises the
encoded video to the first kept step; the live tools built on causal students (daydreamlive/scope, Krea's server,
StreamDiffusionV2) noise every chunk the same way, ``latents = (1 - s) * encoded + s * noise``. Here:

* [`first_kept_step`]: diffusers' trim, the index of the first kept step (``N``: nothing to denoise).
* [`noise_to_strength`]: a chunk's starting latents and first step from its encoded latents, its noise and the
  schedule's sigmas, with ``s`` the sigma of the first kept step. ``strength = 0`` returns the encoded latents
  untouched (no step kept); ``strength = 1`` keeps every step and starts from the noise itself, exactly the start of
  text-to-video with that noise.
* [`StrengthSchedule`]: ``strength`` per chunk, from a float, a callable ``chunk_index -> strength``, a schedule
  ``{chunk_index: strength}`` (each value holds from its chunk on) or a [`MotionAwareStrength`] controller.
* [`MotionAwareStrength`]: an optional controller (StreamDiffusionV2's motion-aware noise, as daydreamlive/scope runs
  it) that lowers the strength when the input frames change fast, so that fast motion follows the input instead of
  being re-imagined; it is not the default.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from numbers import Real

import torch


def _check_value(value: object, name: str = "strength") -> float:
    """``value`` as a float in [0, 1], else a ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, Real) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"`{name}` must be a number in [0, 1], got {value!r}.")
    return float(value)


def first_kept_step(num_inference_steps: int, strength: float, order: int = 1) -> int:
    """Index in the scheduler's timesteps of the first step a chunk of ``strength`` runs (diffusers' trim:
    ``N - min(int(N * strength), N)``, times the scheduler's ``order``); ``N * order`` when no step is kept.

    Examples: with 4 steps, strength 1 keeps all (0), 0.75 keeps 3 (1), 0.6 keeps 2 (2), 0.2 keeps none (4)."""
    kept = min(int(num_inference_steps * strength), num_inference_steps)
    return max(num_inference_steps - kept, 0) * order


def noise_to_strength(
    encoded: torch.Tensor, noise: torch.Tensor, sigmas: torch.Tensor, strength: float, order: int = 1
) -> tuple[torch.Tensor, int]:
    """Starting latents of a video-to-video chunk and the index of its first denoising step.

    Args:
        encoded: ``(B, C, F, h, w)`` normalized latents of the input chunk.
        noise: noise of the same shape (the chunk's share of a text-to-video rollout's noise).
        sigmas: the scheduler's sigmas after ``set_timesteps`` (``N`` steps, optionally followed by the final 0).
        strength: in [0, 1].
        order: the scheduler's order (1 for the flow-matching Euler scheduler).

    Returns:
        ``(latents, begin_index)``: the chunk runs the scheduler's timesteps from ``begin_index`` on
        (``scheduler.set_begin_index(begin_index)``). ``begin_index == N * order``: ``latents`` is ``encoded`` itself,
        nothing to denoise. ``begin_index == 0``: ``latents`` is ``noise`` itself, as text-to-video starts. Else
        ``(1 - s) * encoded + s * noise`` with ``s = sigmas[begin_index]``.
    """
    strength = _check_value(strength)
    if encoded.shape != noise.shape:
        raise ValueError(f"`noise` must have the shape of `encoded` {tuple(encoded.shape)}, got {tuple(noise.shape)}.")
    num_steps = (len(sigmas) - 1 if float(sigmas[-1]) == 0.0 else len(sigmas)) // order
    begin_index = first_kept_step(num_steps, strength, order)
    if begin_index >= num_steps * order:
        return encoded, begin_index
    if begin_index == 0:
        return noise, 0
    sigma = sigmas[begin_index].to(encoded.device, encoded.dtype)
    return (1.0 - sigma) * encoded + sigma * noise, begin_index


class MotionAwareStrength:
    r"""Lower the video-to-video strength when the input frames change fast (StreamDiffusionV2's motion-aware noise).

    For each chunk of pixel frames (in [-1, 1]) the motion is the largest root-mean-square difference between
    consecutive frames (the first frame compared with the last frame of the previous chunk), divided by
    ``motion_scale`` and clipped to [0, 1]. The chunk's strength moves towards ``max_strength - sensitivity * motion``:

    ``strength = (1 - smoothing) * (max_strength - sensitivity * motion) + smoothing * previous_strength``

    so a still input is re-imagined at ``max_strength`` and fast motion keeps more of the input. The defaults are the
    ones daydreamlive/scope ships (0.8, 0.2, 0.2 and 0.1, starting from 0.7). With few denoising steps the strength
    acts through [`first_kept_step`], in steps of ``1 / N``.

    Args:
        max_strength: the strength of a still input, in [0, 1].
        sensitivity: how much full motion lowers it, in [0, max_strength].
        motion_scale: the RMS frame difference (in [-1, 1] pixel units) counted as full motion, > 0.
        smoothing: weight of the previous chunk's strength, in [0, 1).
        initial_strength: the "previous" strength of the first chunk, in [0, 1].
    """

    def __init__(
        self,
        max_strength: float = 0.8,
        sensitivity: float = 0.2,
        motion_scale: float = 0.2,
        smoothing: float = 0.1,
        initial_strength: float = 0.7,
    ):
        _check_value(max_strength, "max_strength")
        _check_value(initial_strength, "initial_strength")
        if not 0.0 <= sensitivity <= max_strength:
            raise ValueError(f"`sensitivity` must be in [0, max_strength={max_strength}], got {sensitivity!r}.")
        if not motion_scale > 0.0:
            raise ValueError(f"`motion_scale` must be > 0, got {motion_scale!r}.")
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"`smoothing` must be in [0, 1), got {smoothing!r}.")
        self.max_strength = float(max_strength)
        self.sensitivity = float(sensitivity)
        self.motion_scale = float(motion_scale)
        self.smoothing = float(smoothing)
        self.initial_strength = float(initial_strength)
        self.reset()

    def reset(self) -> None:
        """Start a new video."""
        self.strength = self.initial_strength
        self.motion = 0.0
        self._last_frame: torch.Tensor | None = None

    @torch.no_grad()
    def observe(self, pixels: torch.Tensor) -> float:
        """Measure the motion of the next chunk and return its strength.

        Args:
            pixels: ``(B, 3, f, H, W)`` frames of the chunk in [-1, 1], following the chunks observed so far.
        """
        frames = pixels.float()
        if self._last_frame is not None:
            frames = torch.cat([self._last_frame.to(frames), frames], dim=2)
        self._last_frame = pixels[:, :, -1:].detach().float()
        if frames.shape[2] < 2:
            motion = 0.0
        else:
            differences = frames[:, :, 1:] - frames[:, :, :-1]
            rms = differences.pow(2).mean(dim=(0, 1, 3, 4)).sqrt()  # (f - 1,) per pair of frames
            motion = min(float(rms.max()) / self.motion_scale, 1.0)
        self.motion = motion
        target = self.max_strength - self.sensitivity * motion
        self.strength = (1.0 - self.smoothing) * target + self.smoothing * self.strength
        return self.strength


# What `strength` may be: one value, a function of the chunk index, a schedule of changes, or a controller.
StrengthInput = float | Callable[[int], float] | Mapping[int, float] | MotionAwareStrength


class StrengthSchedule:
    r"""The video-to-video strength of every chunk.

    Args:
        strength: a number in [0, 1] for every chunk; a callable ``chunk_index -> strength``; a schedule
            ``{chunk_index: strength}`` whose values hold from their chunk on (it must set chunk 0); or a
            [`MotionAwareStrength`] controller, which reads each chunk's frames.

    Raises:
        ValueError: naming ``strength``, before any work for a number or a schedule; for a callable, when it returns
            a value outside [0, 1] (before the chunk is noised).
    """

    def __init__(self, strength: StrengthInput):
        self.strength = strength
        if isinstance(strength, MotionAwareStrength):
            return
        if isinstance(strength, Mapping):
            if not strength:
                raise ValueError("`strength` schedule is empty; it must set chunk 0, e.g. {0: 0.7}.")
            for index, value in strength.items():
                if isinstance(index, bool) or not isinstance(index, int) or index < 0:
                    raise ValueError(f"`strength` schedule keys must be chunk indices >= 0, got {index!r}.")
                _check_value(value, f"strength[{index}]")
            if 0 not in strength:
                raise ValueError(f"`strength` schedule must set chunk 0, got chunks {sorted(strength)}.")
            self._changes = sorted(strength.items())
        elif not callable(strength):
            _check_value(strength)

    def reset(self) -> None:
        """Start a new video (a motion-aware controller forgets the previous video's frames and strength)."""
        if isinstance(self.strength, MotionAwareStrength):
            self.strength.reset()

    @property
    def needs_frames(self) -> bool:
        """Whether [`at`] reads the chunk's pixel frames (a motion-aware controller)."""
        return isinstance(self.strength, MotionAwareStrength)

    def at(self, chunk_index: int, pixels: torch.Tensor | None = None) -> float:
        """The strength of chunk ``chunk_index``; ``pixels`` (its ``(B, 3, f, H, W)`` frames in [-1, 1]) are read by a
        motion-aware controller, which must see every chunk once, in order."""
        strength = self.strength
        if isinstance(strength, MotionAwareStrength):
            if pixels is None:
                raise ValueError("a motion-aware `strength` needs the chunk's pixel frames.")
            return strength.observe(pixels)
        if isinstance(strength, Mapping):
            value = 0.0
            for index, change in self._changes:
                if index > chunk_index:
                    break
                value = change
            return float(value)
        if callable(strength):
            return _check_value(strength(chunk_index), f"strength({chunk_index})")
        return float(strength)
