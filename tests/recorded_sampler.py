"""The upstream projects' flow-matching sampler, replayed from a recording, as a pipeline's scheduler.

Shared by the reference tests of the prompt-switch policies (``tests/data/infinity_rope_tiny``,
``tests/data/longlive_tiny``): upstream steps ``x0 = x - sigma * v`` in float64 with the recorded sigma of each
timestep and re-noises with draws it made with ``torch.randn_like`` in its ``[B, F, C, H, W]`` layout; the recording
keeps them, and only the name of each draw differs between projects (``renoise_key``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch


def model_layout(x: torch.Tensor) -> torch.Tensor:
    """``[B, F, C, H, W]`` (the upstream pipelines' layout) to ``[B, C, F, H, W]`` and back (its own inverse)."""
    return x.permute(0, 2, 1, 3, 4)


class RecordedSampler:
    """Timesteps as given, ``x0 = x - sigma * v`` in float64 with the recorded sigmas (``meta["sigmas"]``), and the
    re-noise after step ``index`` of chunk ``chunk`` (of ``steps`` re-noising steps per chunk) the recorded draw
    ``inputs[renoise_key(chunk, index, steps)]``. Chunks are counted by ``set_timesteps``."""

    def __init__(
        self,
        scheduler,
        meta: Mapping,
        inputs: Mapping[str, torch.Tensor],
        renoise_key: Callable[[int, int, int], str],
    ):
        self.config, self.shift, self.order = scheduler.config, scheduler.shift, 1
        self.sigma_of = {float(t): sigma for t, sigma in meta["sigmas"].items()}
        self.inputs, self.renoise_key, self.chunk = inputs, renoise_key, -1

    def set_timesteps(self, timesteps=None, device=None, **_):
        self.chunk, self.index = self.chunk + 1, 0
        self.timesteps = torch.tensor(timesteps, dtype=torch.float32)

    def set_begin_index(self, index):
        self.index = index

    def step(self, flow, t, x, generator=None, return_dict=False):
        x0 = (x.double() - self.sigma_of[float(t)] * flow.double()).float()
        if self.index + 1 < len(self.timesteps):
            sigma = self.sigma_of[float(self.timesteps[self.index + 1])]
            eps = self.inputs[self.renoise_key(self.chunk, self.index, len(self.timesteps) - 1)]
            x0 = (1 - sigma) * x0 + sigma * model_layout(eps)
        self.index += 1
        return (x0,)
