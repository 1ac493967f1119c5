"""Rolling Forcing's rolling-window denoising: one forward denoises a window of chunks at staggered noise levels.

[`RollingPolicy`] (TencentARC/RollingForcing ``CausalInferencePipeline.inference_rolling_forcing``). With ``N``
denoising levels ``t_0 > ... > t_{N-1}`` and ``K`` chunks, chunk ``b`` enters the window at level 0 (its noise) and
sits at level ``w - b`` in window ``w``; window ``w`` (``0 .. K + N - 2``) holds the chunks
``max(0, w - N + 1) .. min(K - 1, w)``, at most ``N`` of them, the oldest at the lowest noise:

```
for each window w:
    x = [each chunk b of the window: its noise if w == b, else its re-noised latents from window w - 1]  # oldest first
    v = transformer(x, per-frame t_(w - b), text, start_frame=first frame of the window,
                    attention_window=AttentionWindow(A, sink), chunk_layout=(F,))    # one chunk: no mask inside it
    x0 = x - sigma_(w - b) * v                                                   # per chunk, in float64
    for each chunk b of the window below the last level, in order:             # one draw over the window each
        eps = randn((B, F, C, H, W))[chunk b]; x_b = (1 - sigma_(w - b + 1)) * x0_b + sigma_(w - b + 1) * eps
    transformer(x0 of the window's first chunk, context_noise, text, start_frame=its first frame, store_kv=True,
                attention_window=AttentionWindow(A, 0))                          # the commit, under every cache tag
    if the window's first chunk is at the last level: yield it (its x0)
```

Windows ``0 .. N-1`` all commit chunk 0 (re-committed as it is refined, last at its finished level); from window ``N``
on each window commits the chunk that leaves it. Chunk 0 is the anchor: the sink of every denoising forward.

Attention (``A = attention_window``, 21 latent frames upstream): a denoising forward of ``F`` frames at ``s`` sees the
anchor and the last ``A - sink - F`` cached frames before ``s`` (at most ``A`` frames in all, no mask inside the
window); a commit sees the last ``A`` frames, itself included, and no sink (chunk 0 only while it is among them). The
engines hold what both see: a window of ``A + sink`` frames whose sink is chunk 0 (upstream's 24-frame cache for
``A = 21`` and 3-frame chunks); each forward attends under its own window (the transformer's ``attention_window``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.utils.torch_utils import randn_tensor

from ...chunking import ChunkPlan, ChunkSpan
from ...kv_cache import AttentionWindow
from ...settings import RollingSettings
from .policy import RolloutPolicy, SequentialPolicy
from .records import ChunkRecord
from .session import STORE_ONLY, RolloutSession
from .sources import NoiseSource

# the engines' positions mode: the sink re-rotated before the oldest frame attended (the policy's settings say so)
ANCHOR_POSITIONS = RollingSettings.engine_rope_positions


@dataclass(frozen=True)
class RollingWindow:
    """One window of the rolling schedule: chunks ``first .. last`` (indices into the plan), chunk ``b`` at level
    ``index - b``."""

    index: int
    first: int
    last: int

    def level(self, chunk: int) -> int:
        return self.index - chunk

    @property
    def chunks(self) -> range:
        return range(self.first, self.last + 1)


def rolling_windows(num_chunks: int, num_levels: int) -> list[RollingWindow]:
    """The ``num_chunks + num_levels - 1`` windows of a rollout (see the module docstring)."""
    return [
        RollingWindow(w, max(0, w - num_levels + 1), min(num_chunks - 1, w))
        for w in range(num_chunks + num_levels - 1)
    ]


class RollingPolicy(RolloutPolicy):
    """Rolling Forcing's rollout (see the module docstring).

    Args:
        attention_window: latent frames one forward attends to at most (Rolling Forcing's 21): a denoising forward's
            window, the anchor included, and a commit's.
    """

    def __init__(self, attention_window: int | None = None) -> None:
        frames = RollingSettings.ATTENTION_FRAMES if attention_window is None else attention_window
        if isinstance(frames, bool) or not isinstance(frames, int) or frames < 1:
            raise ValueError(f"`attention_window` must be a positive number of latent frames, got {frames!r}.")
        self.attention_window = frames

    # ------------------------------------------------------------------ windows
    def engine_window(self, sink: int) -> AttentionWindow:
        """What the engines must hold for an anchor of ``sink`` frames: the anchor and the last ``A`` frames."""
        return AttentionWindow(self.attention_window + sink, sink)

    def denoise_window(self, sink: int) -> AttentionWindow:
        """The window of a denoising forward: ``A`` frames, the anchor (``sink`` frames) included."""
        return AttentionWindow(self.attention_window, sink)

    def commit_window(self) -> AttentionWindow:
        """The window of a commit: the last ``A`` frames, no sink."""
        return AttentionWindow(self.attention_window)

    def check_plan(self, bounds: list[tuple[int, int]], num_levels: int) -> None:
        """Raise ``ValueError`` for a chunking the rolling schedule cannot serve: fewer chunks than levels (Rolling
        Forcing's windows are only defined from ``N`` chunks on), or a window that does not fit ``A`` frames beside
        the anchor."""
        RollingSettings().check_chunks(bounds, num_levels)
        sink = bounds[0][1] - bounds[0][0]
        for window in rolling_windows(len(bounds), num_levels):
            frames = bounds[window.last][1] - bounds[window.first][0]
            seen = frames + (sink if window.first > 0 else 0)  # the anchor, when it is not in the window itself
            if seen > self.attention_window:
                raise ValueError(
                    f"`attention_window={self.attention_window}` is too small for `kv_cache_policy='rolling'`: window "
                    f"{window.index} denoises {frames} latent frames and sees the {sink}-frame anchor too; use an "
                    f"`attention_window` of at least {seen}."
                )

    def check_engines(self, transformer: Any, sink: int) -> None:
        """Raise ``ValueError`` unless every engine of ``transformer`` holds what the rollout attends to
        ([`engine_window`]) and positions the anchor (``rope_positions="anchor"``): engines set by the caller
        (``kv_cache_engine=None``) are checked before any work."""
        needed = self.engine_window(sink)
        for name, engine in transformer.kv_cache_engines.items():
            if getattr(engine, "rope_positions", "absolute") != ANCHOR_POSITIONS:
                raise ValueError(
                    f"`kv_cache_policy='rolling'` re-positions the anchor at every read, which needs engines built "
                    f"with rope_positions={ANCHOR_POSITIONS!r}; engine {name!r} has "
                    f"{getattr(engine, 'rope_positions', 'absolute')!r} (or let the pipeline configure them: "
                    "`kv_cache_engine='static'`)."
                )
            window = engine.window
            if window.bounded and (window.sink < sink or window.room < needed.room):
                raise ValueError(
                    f"`kv_cache_policy='rolling'` attends to the {sink}-frame anchor and the last "
                    f"{self.attention_window} frames, but engine {name!r} holds window_frames={window.frames}, "
                    f"sink_frames={window.sink}; give it window_frames >= {needed.frames} with sink_frames={sink} "
                    "(or let the pipeline configure it: `kv_cache_engine='static'`)."
                )

    # ------------------------------------------------------------------ the rollout
    def run(
        self,
        pipe: Any,
        session: RolloutSession,
        plan: ChunkPlan,
        source: NoiseSource,
        *,
        generator: torch.Generator | list[torch.Generator] | None = None,
        callback_on_step_end: Callable[..., dict[str, torch.Tensor]] | None = None,
        callback_on_step_end_tensor_inputs: Sequence[str] = ("latents",),
        store_last: bool = False,
        prompt_switches: Mapping[int, torch.Tensor] | None = None,
        recache: bool = False,
    ) -> Iterator[ChunkRecord]:
        """Run ``plan`` window by window, yielding each chunk once it leaves the window (the module docstring).

        ``callback_on_step_end(pipe, window_index, t, {"latents": x0})`` runs after every window's denoising forward,
        with the window's x0 predictions ``(B, C, F_window, H, W)``; returned ``latents`` replace them before the
        re-noising and the commit. ``store_last`` runs the last commit too (it serves nothing else). A prompt schedule
        and ``recache`` are refused (see [`RollingSettings.check`]).
        """
        schedules = {tuple(sorted((k, tuple(v)) for k, v in schedule.items())) for _, schedule in plan}
        # a plan run directly (not through a pipeline call) is asked the policy's own rules
        RollingSettings().check(
            {
                "recache": recache,
                "switch_frames": tuple(prompt_switches or ()),
                "first_chunk_timesteps": plan.schedules[0] if len(schedules) > 1 else None,
            }
        )
        spans = plan.spans
        device = source.noise.device
        pipe.scheduler.set_timesteps(**plan.schedules[0], device=device)
        timesteps = pipe.scheduler.timesteps.float()  # (N,) model-scale levels, noisiest first
        sigmas = pipe.scheduler.sigmas.float()  # (N + 1,): the levels' sigmas, then 0
        num_levels = len(timesteps)
        self.check_plan(plan.bounds, num_levels)
        sink = spans[0].num_frames
        denoise_options = {"attention_window": self.denoise_window(sink)}
        commit_options = {"attention_window": self.commit_window()}
        windows = rolling_windows(len(spans), num_levels)
        noisy: dict[int, torch.Tensor] = {}  # chunk index -> its latents at its next level
        pipe._num_timesteps = len(windows)
        with pipe.progress_bar(total=len(windows)) as progress_bar:
            for window in windows:
                if pipe.interrupt:
                    return
                chunks = [spans[b] for b in window.chunks]
                latents = torch.cat(
                    [
                        source.latents(c) if window.level(b) == 0 else noisy.pop(b)
                        for b, c in zip(window.chunks, chunks)
                    ],
                    dim=2,
                )  # (B, C, F, H, W), oldest chunk first
                span = ChunkSpan(chunks[0].index, chunks[0].start, chunks[-1].end)
                levels = torch.cat(
                    [
                        torch.full((c.num_frames,), window.level(b), device=device)
                        for b, c in zip(window.chunks, chunks)
                    ]
                )  # (F,) level of every frame
                batch_size = latents.shape[0]
                frame_timesteps = timesteps[levels].expand(batch_size, -1)  # (B, F)
                pipe._current_timestep = frame_timesteps[0, 0]
                options = {**denoise_options, "chunk_layout": (span.num_frames,)}
                flow = session.guided_flow(span, latents, frame_timesteps, window.index, call_options=options)
                sigma = sigmas[levels].double().view(1, 1, -1, 1, 1)
                x0 = (latents.double() - sigma * flow.double()).float()
                if callback_on_step_end is not None:
                    x0 = SequentialPolicy._callback(
                        pipe, session, window.index, frame_timesteps[0, 0], x0,
                        callback_on_step_end, callback_on_step_end_tensor_inputs,
                    )  # fmt: skip
                self._renoise(x0, window, chunks, sigmas, num_levels, noisy, generator)
                first = chunks[0]
                clean = x0[:, :, : first.num_frames]
                finished = window.level(window.first) == num_levels - 1
                is_last = finished and window.first == len(spans) - 1
                context = None
                if not is_last or store_last:
                    context = self._commit(session, first, clean, commit_options)
                pipe._current_timestep = None
                progress_bar.update()
                if finished:
                    session.record(first, clean, context)
                    yield ChunkRecord(first.index, first.start, first.end, clean, is_last, context)

    @staticmethod
    def _renoise(x0, window, chunks, sigmas, num_levels, noisy, generator) -> None:
        """Re-noise every chunk of ``window`` below the last level to its next level (one draw over the window each,
        laid out ``(B, F, C, H, W)`` as Rolling Forcing draws it)."""
        batch, channels, frames, height, width = x0.shape
        offset = 0
        for b, chunk in zip(window.chunks, chunks):
            level = window.level(b)
            size = chunk.num_frames
            if level < num_levels - 1:
                eps = randn_tensor(
                    (batch, frames, channels, height, width), generator=generator, device=x0.device, dtype=x0.dtype
                ).transpose(1, 2)
                sigma = sigmas[level + 1]
                noisy[b] = (1 - sigma) * x0[:, :, offset : offset + size] + sigma * eps[:, :, offset : offset + size]
            offset += size

    @staticmethod
    def _commit(session: RolloutSession, chunk: ChunkSpan, clean: torch.Tensor, options) -> torch.Tensor:
        """Write ``chunk``'s ``clean`` latents into every cache tag at the context timestep (the commit)."""
        timestep = session.context_timestep(clean.shape[0], clean.device)
        options = {**options, **STORE_ONLY}  # the prediction is not read: a store-only forward
        for cache_tag in session.cache_tags:
            session.forward(chunk, clean, timestep, cache_tag=cache_tag, store_kv=True, call_options=options)
        return clean
