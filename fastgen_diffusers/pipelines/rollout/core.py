"""The causal rollout core shared by every causal Wan pipeline (T2V, I2V, VACE, streaming).

Layers (each a module of this package, imported one way: pipelines -> session/policy -> conditioning -> chunking):

* [`RolloutOptions`] (``options.py``): the typed arguments of a call.
* [`CausalRolloutMixin.prepare_rollout`] (here): one template for the pipelines: check inputs, encode the
  prompts, build the conditioner (the pipeline's ``prepare_conditioner``), sample the noise, plan the chunks,
  configure the KV cache, open a [`RolloutSession`]. The pipelines differ only in the hooks
  ``check_conditioning_inputs``, ``check_conditioning_fits`` and ``prepare_conditioner``.
* [`RolloutSession`] (``session.py``): a rollout's state (cache tags, prompts, guidance, context noise, conditioner,
  bounded history); kept rollouts are sessions.
* [`RolloutPolicy`] (``policy.py``): runs a [`ChunkPlan`] on a session and yields [`ChunkRecord`]s;
  [`SequentialPolicy`] is the chunk-by-chunk loop. ``__call__``, ``stream``, continue, redo and fork all run it
  through [`CausalRolloutMixin.run_policy`], which owns the cache lifecycle (clear, keep, discard).
* Layers of the mixin, one job each: [`PolicyChoiceMixin`] (``policy_choice.py``: which policy runs a call, which
  pipelines run which, the policy options' checks), [`KVCacheOptionsMixin`] (``kv_cache_options.py``: the engines
  of a call, their checks and configuration), [`PromptScheduleMixin`] (``prompts.py``: prompt schedules).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch
from diffusers.callbacks import MultiPipelineCallbacks, PipelineCallback
from diffusers.pipelines.wan.pipeline_output import WanPipelineOutput
from diffusers.utils.torch_utils import get_module_execution_device

from ...chunking import ChunkPlan, OpenEndedChunkPlan, chunk_bounds, chunk_layout
from ...parallel import is_main_process
from ...settings import RolloutSettings, argument_names, check_rope_table
from ..video_io.autoencoders import streaming_decoder
from ..video_io.decode_overlap import DecodedChunk, OverlappedDecoder
from ..video_io.streaming_decode import denormalize_latents
from .arguments import prepare_call_options
from .conditioning import Conditioner
from .guard import exclusive_rollout, warn_discarding_kept_rollouts
from .kv_cache_options import KVCacheOptionsMixin
from .options import RolloutOptions, call_options
from .policy import RolloutPolicy, SequentialPolicy
from .policy_choice import PolicyChoiceMixin
from .policy_recompute import RecomputePolicy
from .prompt_switch import PromptSwitchRule
from .prompts import PromptScheduleMixin, check_transition_embeds
from .records import ChunkOutput, ChunkRecord
from .session import MAIN_BRANCH, RolloutSession, discard_branch, history_to_keep
from .sources import EndlessNoiseSource, NoiseSource

OUTPUT_TYPES = ("np", "pil", "pt", "latent")

__all__ = [
    "OUTPUT_TYPES",
    "CausalRolloutMixin",
    "ChunkOutput",
    "RolloutRun",
    "RolloutShape",
]


@dataclass(frozen=True)
class RolloutShape:
    """What a call generates: ``num_frames`` pixel frames of ``height`` x ``width`` (VACE's reference images
    included, as ``4 * num_reference_frames`` leading pixel frames), ``num_reference_frames`` leading latent frames
    that are not video frames."""

    height: int
    width: int
    num_frames: int
    num_reference_frames: int = 0


@dataclass
class RolloutRun:
    """A generation prepared by [`CausalRolloutMixin.prepare_rollout`]: ``__call__`` and ``stream`` run its chunks.

    Args:
        pipe: the pipeline that prepared the run.
        session: the rollout's [`RolloutSession`] (kept by the pipeline after a ``keep_cache=True`` run).
        plan: the chunks and their schedules.
        source: the starting noise of every chunk.
        options: the call's resolved options.
        prompt_switches: ``{chunk_index: (B, L, text_dim)}`` prompt switches.
        num_reference_frames: leading latent frames that are not video frames (VACE's reference images): they are
            generated with the video but never decoded.
        policy: the [`RolloutPolicy`] that runs the plan.
    """

    pipe: CausalRolloutMixin
    session: RolloutSession
    plan: ChunkPlan
    source: NoiseSource
    options: RolloutOptions
    prompt_switches: dict[int, torch.Tensor]
    num_reference_frames: int = 0
    policy: RolloutPolicy | None = None

    def switch_prompt(
        self, chunk_index: int, prompt_embeds: torch.Tensor, transition_chunks: int | None = None
    ) -> None:
        """Switch the conditional prompt to ``prompt_embeds`` (``(B, L, text_dim)``) from chunk ``chunk_index`` on,
        while the rollout runs (a live prompt change): the switch is read when that chunk begins, exactly as a prompt
        schedule's switch at that chunk, blended in over ``transition_chunks`` chunks (default: the call's
        ``prompt_transition_chunks``), with the call's switch settings (``recache``, whose history a run with
        ``recache=True`` keeps from its start, ``recache_sink``, ``kv_flush``). The caller picks a chunk that has not
        begun (a begun chunk never reads it)."""
        options = self.options
        n = self.session.prompt_transition_chunks if transition_chunks is None else transition_chunks
        if transition_chunks is not None:
            # the call's settings with this transition, checked as a whole (a KV flush or a scene cut switches at once)
            settings = options.settings.replace(prompts=options.settings.prompts.replace(prompt_transition_chunks=n))
            options = replace(options, prompt_transition_chunks=n, settings=settings)
        check_transition_embeds(n, self.session.prompt_embeds, {0: prompt_embeds})
        # every check passed: only now the run changes
        self.options = options
        self.session.prompt_transition_chunks = n
        self.prompt_switches[chunk_index] = prompt_embeds

    def endless(self) -> RolloutRun:
        """This run without an end (an endless stream): its planned chunks, then chunks of its chunk size on its
        schedule for as long as they are asked for, each from fresh noise of the call's generator drawn as the chunk
        starts; its planned chunks are the run's own, frame for frame. No chunk is the last: the caller ends it by
        closing the stream, and keeps memory flat by settings that bound the cache and the RoPE positions (ask
        ``RolloutSettings.check_chunks`` about a plan longer than the RoPE table).

        Raises:
            ValueError: the run's policy needs its chunks up front (a rolling window), keeps its cache
                (``keep_cache=True``) or starts its chunks from something other than noise.
        """
        if self.policy is None or not self.policy.runs_open_ended_plans:
            raise ValueError(
                f"The run's policy ({type(self.policy).__name__}) plans its chunks up front: it cannot run without an "
                "end. Ask for a `num_frames`."
            )
        if self.options.keep_cache:
            raise ValueError("An endless run has no last chunk to keep the cache after: pass keep_cache=False.")
        if type(self.source) is not NoiseSource or self.source.start_frame != 0:
            raise ValueError(
                f"Only a run started from noise can go on without an end, not {type(self.source).__name__}."
            )
        chunk_size = self.options.chunk_size or self.pipe.transformer.config.chunk_size
        plan = OpenEndedChunkPlan(self.plan, chunk_size, self.session.schedule)
        return replace(self, plan=plan, source=EndlessNoiseSource(self.source.noise, self.options.generator))

    def chunks(self) -> Iterator[ChunkRecord]:
        """The rollout's finished chunks, one by one (see [`CausalRolloutMixin.run_policy`])."""
        options = self.options
        return self.pipe.run_policy(
            self.session,
            self.plan,
            self.source,
            policy=self.policy,
            generator=options.generator,
            callback_on_step_end=options.callback_on_step_end,
            callback_on_step_end_tensor_inputs=options.callback_on_step_end_tensor_inputs,
            keep_cache=options.keep_cache,
            prompt_switches=self.prompt_switches,
            recache=options.recache,
        )


class CausalRolloutMixin(PromptScheduleMixin, PolicyChoiceMixin, KVCacheOptionsMixin):
    r"""The causal rollout of the Wan pipelines: the prepare template, the kept sessions and the policy runner.

    The host pipeline provides ``transformer`` (a causal Wan transformer), ``scheduler``
    (`FlowMatchEulerDiscreteScheduler`, ``stochastic_sampling=True`` for the students' few-step update), ``vae``,
    ``video_processor``, [`~DiffusionPipeline.progress_bar`], ``encode_prompt``, ``prepare_latents`` and
    ``check_inputs``; a pipeline variant overrides ``check_conditioning_inputs``, ``check_conditioning_fits`` and
    ``prepare_conditioner``.
    """

    _callback_tensor_inputs = ["latents", "prompt_embeds", "negative_prompt_embeds"]
    _options_class: type[RolloutOptions] = RolloutOptions
    default_policy: RolloutPolicy = SequentialPolicy()
    supports_keep_cache = True  # False: `keep_cache=True` is refused (video-to-video: its input cannot be continued)
    recompute_policy_class: type[RecomputePolicy] | None = RecomputePolicy  # what `kv_cache_policy="recompute"` runs

    def _init_rollout_state(self) -> None:
        """The rollout state a pipeline holds (set up by ``__init__``): its kept sessions by branch name, and the
        values behind diffusers' callback properties (``guidance_scale``, ``interrupt``, ...). A call's own state
        lives in its [`RolloutRun`] and session."""
        self._sessions: dict[str, RolloutSession] = {}
        self._guidance_scale = 1.0
        self._attention_kwargs = None
        self._current_timestep = None
        self._interrupt = False
        self._num_timesteps = 0
        self._decode_overlap = False

    # ------------------------------------------------------------------ decode overlap
    def enable_decode_overlap(self) -> None:
        """Decode each chunk of ``__call__`` on its own CUDA stream while the next chunk denoises (frames identical
        to the serial decode; see [`OverlappedDecoder`]). Without it, or on a CPU, each chunk is decoded as it comes
        before the next one denoises. Not with VAE tiling or an offloaded VAE (then the frames are decoded at the
        end)."""
        self._decode_overlap = True

    def disable_decode_overlap(self) -> None:
        """Decode each chunk of ``__call__`` before the next one denoises (the default)."""
        self._decode_overlap = False

    @property
    def decode_overlap(self) -> bool:
        """Whether ``__call__`` decodes each chunk while the next one denoises ([`enable_decode_overlap`])."""
        return getattr(self, "_decode_overlap", False)

    # ------------------------------------------------------------------ hooks of the pipeline variants
    def check_conditioning_inputs(self, options: RolloutOptions, batch_size: int) -> RolloutShape:
        """Raise ``ValueError`` for conditioning inputs the pipeline cannot take (before any other check); returns
        the call's [`RolloutShape`]. Text-to-video takes no conditioning."""
        return RolloutShape(options.height, options.width, options.num_frames)

    def check_conditioning_fits(self, options: RolloutOptions, bounds: Sequence[tuple[int, int]]) -> None:
        """Raise ``ValueError`` when the conditioning does not fit the rollout's chunks ``bounds``."""

    def prepare_conditioner(
        self, options: RolloutOptions, shape: RolloutShape, batch_size: int, device: torch.device
    ) -> Conditioner:
        """Encode the call's conditioning into the [`Conditioner`] of its session. Text-to-video: text only."""
        return Conditioner()

    def conditions_chunks(self) -> bool:
        """Whether the pipeline conditions its chunks by frame (an image, a clip, a control video: its own
        ``prepare_conditioner``): a forward's conditioning is read at the forward's frames."""
        return type(self).prepare_conditioner is not CausalRolloutMixin.prepare_conditioner

    # ------------------------------------------------------------------ the prepare template
    def stored_settings(self) -> RolloutSettings:
        """The pipeline's stored settings (its config, written by ``fastgen-diffusers convert``) as this pipeline can
        use them: a stored policy it cannot run (a stored ``"rolling"`` or ``"recompute"`` on the image-to-video or
        VACE pipeline) is left out with its options and attention bias (it samples sequentially), as is an attention
        bias its transformer cannot take."""
        stored = RolloutSettings.from_config(self.config)
        if stored.policy is not None and not self.supports_policy(stored.policy):
            stored = stored.without_policy()
        if stored.cache.kv_cache_attention_bias is not None and not self.supports_attention_bias():
            stored = replace(stored, cache=stored.cache.replace(kv_cache_attention_bias=None))
        return stored

    def resolve_options(self, options: RolloutOptions) -> RolloutOptions:
        """``options`` with their settings built once ([`RolloutSettings`], checked as a whole) and the pipeline's
        stored settings filling what the call left out, field by field ([`RolloutSettings.with_arguments`]): a
        ``settings=`` value of the call stands where its flat arguments keep their defaults. Also a
        ``PipelineCallback``'s ``tensor_inputs``."""
        changes: dict[str, Any] = {}
        if isinstance(options.callback_on_step_end, (PipelineCallback, MultiPipelineCallbacks)):
            changes["callback_on_step_end_tensor_inputs"] = options.callback_on_step_end.tensor_inputs
        names = [name for name in argument_names() if hasattr(options, name)]
        call = {name: getattr(options, name) for name in names}
        if options.settings is not None:
            if not isinstance(options.settings, RolloutSettings):
                raise ValueError(
                    f"`settings` must be a RolloutSettings or None, got {type(options.settings).__name__} (JSON "
                    "settings: `RolloutSettings.from_dict(data)`)."
                )
            defaults = {f.name: f.default for f in fields(options) if f.name in call}
            given = {name: value for name, value in call.items() if value != defaults[name]}
            call = {**options.settings.arguments(), **given}
        self.check_policy_inputs(call.get("kv_cache_policy"), call.get("kv_cache_attention_bias"))
        schedule = options.prompt if isinstance(options.prompt, Mapping) else options.prompt_embeds
        switches = [frame for frame in schedule if frame] if isinstance(schedule, Mapping) else ()
        settings = self.stored_settings().with_arguments(call, switch_frames=switches)
        resolved = settings.resolved_arguments()
        changes.update({name: resolved[name] for name in names})
        return replace(options, **changes, settings=settings)

    @staticmethod
    def batch_size_of(prompt: Any, prompt_embeds: Any) -> int:
        """The batch of a call: one per prompt, else the embeddings' batch (1 while they are still unchecked)."""
        if isinstance(prompt, str):
            return 1
        if isinstance(prompt, list):
            return len(prompt)
        return prompt_embeds.shape[0] if isinstance(prompt_embeds, torch.Tensor) else 1

    @torch.no_grad()
    def prepare_rollout(self, options: RolloutOptions) -> RolloutRun:
        """Everything ``__call__`` does before its denoising loop, shared with ``stream``: check the inputs (before
        any model work), encode the prompts and the conditioning, sample the noise, plan the chunks, configure the
        KV cache and open the session.

        Returns:
            The [`RolloutRun`] to roll out.
        """
        options = self.resolve_options(prepare_call_options(self, options))

        # 1. Check inputs. Raise error if not correct
        prompt, prompt_embeds, prompt_schedule = self.split_prompt_schedule(options.prompt, options.prompt_embeds)
        options = replace(options, prompt=prompt, prompt_embeds=prompt_embeds)
        batch_size = self.batch_size_of(prompt, prompt_embeds)
        shape = self.check_conditioning_inputs(options, batch_size)
        self.check_inputs(options, shape, batch_size)
        num_latent_frames = (shape.num_frames - 1) // self.vae_scale_factor_temporal + 1
        bounds = self.rollout_chunk_bounds(num_latent_frames, options.chunk_size)
        self.check_conditioning_fits(options, bounds)
        chunk_size = options.chunk_size or self.transformer.config.chunk_size
        options.settings.check_chunks(bounds, chunk_size, leading_frames=shape.num_reference_frames)
        schedule, first_schedule = self.call_schedules(options)
        policy = self.select_policy(options)  # once: the checks below and the run use this one
        rolling = self.check_rolling_rollout(options, bounds, len(schedule["sigmas"]), policy)

        # 2. Encode input prompt
        device = self._execution_device
        prompt_embeds, negative_prompt_embeds, prompt_switches = self.encode_call_prompts(
            options, prompt, prompt_embeds, prompt_schedule, device
        )

        # 3. Encode the conditioning (once: every forward reuses the same tensors, so the cross K/V cache recognizes
        # its conditioning)
        conditioner = self.prepare_conditioner(options, shape, batch_size, device)

        # 4. Prepare latent variables (the timesteps, `schedule`, are set on the scheduler again at every chunk)
        latents = self.prepare_latents(
            batch_size,
            self.transformer.config.out_channels,
            shape.height,
            shape.width,
            shape.num_frames,
            torch.float32,
            device,
            options.generator,
            options.latents,
        )

        # 5. Plan the chunks (prompt schedules count video pixel frames: reference frames come before frame 0), then
        # fresh KV-cache engines (after every check that can raise, so a bad schedule never resets a kept rollout)
        plan = ChunkPlan.from_bounds(bounds, schedule, first_schedule=first_schedule)
        refs = shape.num_reference_frames
        video_bounds = [(max(s - refs, 0), e - refs) for s, e in bounds]
        switches = self.prompt_switch_chunks(prompt_switches, video_bounds)
        switch_rule = self.prompt_switch_rule(options, video_bounds)
        check_transition_embeds(options.prompt_transition_chunks, prompt_embeds, switches)
        self.configure_rollout_cache(options, bounds, rolling=rolling)
        session = self.open_call_session(
            options, conditioner, prompt_embeds, negative_prompt_embeds, schedule, first_schedule, switch_rule, refs
        )
        return RolloutRun(self, session, plan, NoiseSource(latents), options, switches, refs, policy)

    def open_call_session(
        self,
        options: RolloutOptions,
        conditioner: Conditioner,
        prompt_embeds: torch.Tensor,
        negative_prompt_embeds: torch.Tensor | None,
        schedule: Mapping[str, Any],
        first_schedule: Mapping[str, Any] | None,
        switch_rule: PromptSwitchRule,
        num_reference_frames: int = 0,
    ) -> RolloutSession:
        """[`open_session`] for a call with resolved ``options`` (guidance, context noise, attention kwargs, prompt
        transitions, attention bias) and its prompt switches' ``switch_rule``, keeping the history a recache needs,
        with or without a scheduled switch: a live one may come (`run.switch_prompt`)."""
        return self.open_session(
            conditioner,
            prompt_embeds,
            negative_prompt_embeds,
            guidance_scale=options.guidance_scale,
            context_noise=options.context_noise,
            schedule=schedule,
            first_schedule=first_schedule,
            attention_kwargs=options.attention_kwargs,
            keep_history=history_to_keep(options.keep_cache, options.recache),
            num_reference_frames=num_reference_frames,
            prompt_transition_chunks=options.prompt_transition_chunks,
            kv_cache_attention_bias=options.kv_cache_attention_bias,
            switch_rule=switch_rule,
        )

    def prompt_switch_rule(self, options: RolloutOptions, video_bounds: Sequence[tuple[int, int]]) -> PromptSwitchRule:
        """What the prompt switches of a call with resolved ``options`` do to the caches: its settings'
        ``recache_sink`` and ``kv_flush``, and the chunks (of the video's chunks ``video_bounds``) its scene cuts take
        effect at."""
        prompts = options.settings.prompts
        cuts = self.prompt_switch_chunks(dict.fromkeys(prompts.cut_frames), video_bounds)
        return PromptSwitchRule(prompts.recache_sink, prompts.kv_flush, frozenset(cuts))

    def open_session(
        self,
        conditioner: Conditioner,
        prompt_embeds: torch.Tensor,
        negative_prompt_embeds: torch.Tensor | None = None,
        *,
        guidance_scale: float = 1.0,
        context_noise: float = 0.0,
        schedule: Mapping[str, Any],
        first_schedule: Mapping[str, Any] | None = None,
        attention_kwargs: dict[str, Any] | None = None,
        branch: str = MAIN_BRANCH,
        keep_history: bool | str = True,
        num_reference_frames: int = 0,
        prompt_transition_chunks: int = 0,
        kv_cache_attention_bias: float | None = None,
        switch_rule: PromptSwitchRule | None = None,
    ) -> RolloutSession:
        """A new [`RolloutSession`] on this pipeline's transformer. ``kv_cache_attention_bias``: the KV-cache attention
        bias of every denoising forward, whatever the policy and window (``None``: 1, off; a recompute policy sets its
        own)."""
        session = RolloutSession(
            self.transformer,
            conditioner,
            prompt_embeds=prompt_embeds,
            negative_prompt_embeds=negative_prompt_embeds,
            guidance_scale=guidance_scale,
            context_noise=context_noise,
            schedule=schedule,
            first_schedule=first_schedule,
            attention_kwargs=attention_kwargs,
            num_train_timesteps=self.scheduler.config.num_train_timesteps,
            branch=branch,
            keep_history=keep_history,
            num_reference_frames=num_reference_frames,
            prompt_transition_chunks=prompt_transition_chunks or 0,
            switch_rule=switch_rule,
        )
        session.attention_bias = 1.0 if kv_cache_attention_bias is None else float(kv_cache_attention_bias)
        return session

    def generate_call(self, arguments: Mapping[str, Any]) -> WanPipelineOutput | tuple:
        """The body of every causal pipeline's ``__call__``: its arguments (``locals()``) as the pipeline's options
        ([`call_options`]), generated."""
        return self.generate(call_options(self._options_class, arguments))

    @exclusive_rollout("pipe(...)")
    def generate(self, options: RolloutOptions) -> WanPipelineOutput | tuple:
        """The body of every causal pipeline's ``__call__``: prepare, roll out chunk by chunk, decode."""
        run = self.prepare_rollout(options)
        latents = run.source.noise.clone()

        # 6. Denoising loop: the causal rollout, chunk by chunk, each chunk's decode queued before the next denoises
        chunks, pixels = self.run_and_decode_chunks(run)
        for chunk in chunks:
            latents[:, :, chunk.start : chunk.end] = chunk.latents

        # 7. Decode, offload all models
        complete = len(pixels) == len(run.plan.spans) and all(p is not None for p in pixels)
        return self.finish_output(
            latents[:, :, run.num_reference_frames :],
            run.options.output_type,
            run.options.return_dict,
            pixels=pixels if complete else None,
        )

    def run_and_decode_chunks(self, run: RolloutRun) -> tuple[list[ChunkRecord], list[torch.Tensor | None]]:
        """Run ``run``'s chunks for ``__call__``, each decoded as it comes with the streamed decoder ``stream()`` uses
        (the same frames, bit for bit; on a side CUDA stream while the next chunk denoises under
        [`enable_decode_overlap`]), unless tiling decodes differently or the VAE is offloaded (model CPU offload would
        move the transformer out and back for every chunk): then nothing is decoded here and [`finish_output`]
        decodes the latents once at the end. A chunk the policy decoded itself (recompute's re-encoding) hands its
        frames over.

        Returns:
            The finished chunks, and per chunk its new frames in [-1, 1] (``(B, 3, f, H*8, W*8)``), ``None`` for a
            chunk not decoded (no decode, or reference frames only).
        """
        decodes = run.options.output_type != "latent" and is_main_process(self.transformer)
        chunk_decoder = None
        if decodes and not self.vae.use_tiling and not hasattr(self.vae, "_hf_hook"):
            chunk_decoder = OverlappedDecoder(
                streaming_decoder(self.vae), self._execution_device, overlap=self.decode_overlap
            )
        chunks: list[ChunkRecord] = []
        pixels: list[torch.Tensor | DecodedChunk | None] = []
        try:
            for chunk in run.chunks():
                chunks.append(chunk)
                video = chunk.latents[:, :, max(0, run.num_reference_frames - chunk.start) :]
                if chunk_decoder is not None and chunk.pixels is None and video.shape[2] > 0:
                    pixels.append(chunk_decoder.submit(video))
                else:
                    pixels.append(chunk.pixels)
        finally:
            if chunk_decoder is not None:
                chunk_decoder.decoder.close()
        return chunks, [p.frames() if isinstance(p, DecodedChunk) else p for p in pixels]

    def finish_output(
        self,
        latents: torch.Tensor,
        output_type: str,
        return_dict: bool,
        pixels: Sequence[torch.Tensor] | None = None,
    ) -> WanPipelineOutput | tuple:
        """Decode ``latents`` (see [`decode_latents`]), offload the models and return the frames as ``__call__``
        does: a ``WanPipelineOutput``, or ``(frames,)`` when ``return_dict`` is ``False``. ``pixels``: the frames of
        every chunk already decoded by the streamed decoder (the recompute policy's), post-processed instead of
        decoding ``latents`` again (they are equal); ignored with VAE tiling, which decodes differently."""
        if pixels is not None and output_type != "latent" and is_main_process(self.transformer):
            if not self.vae.use_tiling:
                video = self.video_processor.postprocess_video(torch.cat(list(pixels), dim=2), output_type=output_type)
                self.maybe_free_model_hooks()
                return WanPipelineOutput(frames=video) if return_dict else (video,)
        video = self.decode_latents(latents, output_type)
        self.maybe_free_model_hooks()
        if not return_dict:
            return (video,)
        return WanPipelineOutput(frames=video)

    # ------------------------------------------------------------------ running a policy on a session
    def run_policy(
        self,
        session: RolloutSession,
        plan: ChunkPlan,
        source: NoiseSource,
        *,
        policy: RolloutPolicy | None = None,
        generator: torch.Generator | list[torch.Generator] | None = None,
        callback_on_step_end: Callable[..., dict[str, torch.Tensor]] | None = None,
        callback_on_step_end_tensor_inputs: Sequence[str] = ("latents",),
        keep_cache: bool = False,
        prompt_switches: Mapping[int, torch.Tensor] | None = None,
        recache: bool = False,
        resume: bool = False,
    ) -> Iterator[ChunkRecord]:
        """Run ``plan`` on ``session`` with ``policy`` (the pipeline's ``default_policy``), owning the cache lifecycle.

        A fresh rollout clears every cache first; ``resume`` continues ``session`` (a kept one) instead. On exit,
        normal or not, the caches are freed unless ``keep_cache`` is set and the last chunk was handed out (then the
        session is kept as its branch); an exception, an interruption (``self._interrupt = True`` from a callback)
        or closing the generator early therefore leaves the pipeline exactly as fresh as before (a resumed rollout
        leaves its branch to the caller: ``continue_rollout`` and ``redo_last_chunk`` restore it).
        """
        policy = policy or session.policy or self.default_policy
        session.policy = policy  # a continuation of a kept rollout runs its policy again
        self._guidance_scale = session.guidance_scale
        self._attention_kwargs = session.attention_kwargs
        self._current_timestep = None
        self._interrupt = False
        if not resume:
            warn_discarding_kept_rollouts(self)
            self._free_rollouts()
        kept = False
        try:
            for chunk in policy.run(
                self,
                session,
                plan,
                source,
                generator=generator,
                callback_on_step_end=callback_on_step_end,
                callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
                store_last=keep_cache,
                prompt_switches=prompt_switches,
                recache=recache,
            ):
                if chunk.is_last and keep_cache:  # kept before it is handed out: a consumer may stop right after
                    self._sessions[session.branch] = session
                    kept = True
                yield chunk
        finally:
            self._current_timestep = None
            if not kept and not resume:
                self._free_rollouts()
            # An unfinished continuation leaves its branch to the caller, which restores it (`BranchCheckpoint`).

    @exclusive_rollout("rollout()")
    def rollout(
        self,
        latents: torch.Tensor,
        prompt_embeds: torch.Tensor,
        negative_prompt_embeds: torch.Tensor | None = None,
        *,
        chunk_bounds: Sequence[tuple[int, int]],
        schedule: dict[str, list[float]],
        guidance_scale: float = 1.0,
        context_noise: float = 0.0,
        generator: torch.Generator | list[torch.Generator] | None = None,
        attention_kwargs: dict[str, Any] | None = None,
        callback_on_step_end: Callable[..., dict[str, torch.Tensor]] | None = None,
        callback_on_step_end_tensor_inputs: Sequence[str] = ("latents",),
        keep_cache: bool = False,
        prompt_switches: Mapping[int, torch.Tensor] | None = None,
        recache: bool = False,
        conditioner: Conditioner | None = None,
    ) -> Iterator[ChunkRecord]:
        """Roll out prepared inputs (no checks, no encoding): the sequential policy on a new session.

        Args:
            latents: ``(B, C, F, H, W)`` float32 initial noise; chunk ``[s, e)`` starts from ``latents[:, :, s:e]``.
            prompt_embeds: ``(B, L, text_dim)`` text embeddings in the transformer's dtype.
            negative_prompt_embeds: ``(B, L', text_dim)``, required when ``guidance_scale > 1``.
            chunk_bounds: ``[start, end)`` of every chunk (see [`rollout_chunk_bounds`]).
            schedule: ``scheduler.set_timesteps`` arguments (see [`rollout_schedule`]), applied at every chunk.
            conditioner: the chunks' [`Conditioner`] (text only by default).
            Others: as in ``__call__``.

        Yields:
            [`ChunkRecord`] per finished chunk, in order. Like a stream, the generator holds the KV caches from its
            first chunk to its end or close: calling the pipeline meanwhile raises a ``RuntimeError`` naming it.
        """
        session = self.open_session(
            conditioner or Conditioner(),
            prompt_embeds,
            negative_prompt_embeds,
            guidance_scale=guidance_scale,
            context_noise=context_noise,
            schedule=schedule,
            attention_kwargs=attention_kwargs,
            keep_history=history_to_keep(keep_cache, recache and bool(prompt_switches)),
        )
        yield from self.run_policy(
            session,
            ChunkPlan.from_bounds(chunk_bounds, schedule),
            NoiseSource(latents),
            generator=generator,
            callback_on_step_end=callback_on_step_end,
            callback_on_step_end_tensor_inputs=callback_on_step_end_tensor_inputs,
            keep_cache=keep_cache,
            prompt_switches=prompt_switches,
            recache=recache,
        )

    # ------------------------------------------------------------------ kept sessions
    @property
    def rollout_branches(self) -> list[str]:
        """Names of the kept rollouts (``"main"`` after ``pipe(..., keep_cache=True)``, then the forks)."""
        return list(self._sessions)

    def kept_rollout(self, branch: str = MAIN_BRANCH) -> RolloutSession:
        """The kept [`RolloutSession`] of ``branch``; ``ValueError`` when there is none."""
        if branch not in self._sessions:
            raise ValueError(
                f"No kept rollout on branch {branch!r} (kept: {sorted(self._sessions)}): run the pipeline with "
                "`keep_cache=True` first, or fork an existing branch"
                + ("." if self.supports_keep_cache else f" ({type(self).__name__} cannot keep rollouts).")
            )
        return self._sessions[branch]

    @exclusive_rollout("discard_rollout()")
    def discard_rollout(self, branch: str | None = None) -> None:
        """Free the caches of ``branch`` (every kept rollout, and every cache, when ``None``).

        Refused with a ``RuntimeError`` while a rollout of this pipeline runs (an open ``stream()``, a ``rollout()``
        generator, a call in another thread or a callback): its caches are in use.
        """
        self._free_rollouts(branch)

    def _free_rollouts(self, branch: str | None = None) -> None:
        """[`discard_rollout`] for the rollout entry points that already hold the caches."""
        if branch is None:
            self.transformer.clear_caches()
            self._sessions.clear()
            return
        self._sessions.pop(branch, None)
        discard_branch(self.transformer, branch)

    # ------------------------------------------------------------------ planning and validation
    def rollout_chunk_bounds(self, num_latent_frames: int, chunk_size: int | None = None) -> list[tuple[int, int]]:
        """``[start, end)`` latent-frame ranges of the chunks, in the partition the transformer's causal mask uses.

        ``chunk_size`` defaults to the transformer's; the first chunk absorbs the remainder, or is the first frame
        alone when the transformer was trained with ``independent_first_frame``.
        """
        config = self.transformer.config
        chunk_size = config.chunk_size if chunk_size is None else chunk_size
        return chunk_bounds(chunk_layout(num_latent_frames, chunk_size, config.independent_first_frame))

    def check_rollout_inputs(
        self,
        num_latent_frames: int,
        chunk_size: int | None,
        rope_positions: str | None = None,
        positions_bounded: bool = False,
    ) -> None:
        """Raise ``ValueError`` for a chunking the rollout cannot serve (the schedule and the context timestep are
        the call's [`SamplingSettings`], checked when they were built).

        ``rope_positions``: the call's positions mode; one whose positions stay within the window
        (``"window"``) serves a video of any length. ``positions_bounded``: the policy keeps RoPE positions below a
        few chunks (as recompute does), so the video may outgrow the RoPE table too."""
        config = self.transformer.config
        self.check_chunk_size(chunk_size)
        check_rope_table(
            num_latent_frames,
            config.rope_max_seq_len,
            rope_positions,
            positions_bounded=positions_bounded,
            rope_rebasing=getattr(self.transformer, "rope_rebasing", False),
        )
        self.check_chunks_served(chunk_size, self.rollout_chunk_bounds(num_latent_frames, chunk_size))

    @staticmethod
    def check_chunk_size(chunk_size: Any) -> None:
        """Raise ``ValueError`` unless ``chunk_size`` is ``None`` or a positive number of latent frames (a call's or a
        continuation's)."""
        if chunk_size is not None and (
            not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1
        ):
            raise ValueError(f"`chunk_size` must be a positive number of latent frames or None, got {chunk_size!r}.")

    def check_chunks_served(self, chunk_size: int | None, bounds: Sequence[tuple[int, int]]) -> None:
        """Raise ``ValueError`` when the transformer's causal mask would split one of the chunks ``bounds`` (made with
        ``chunk_size``) into several (a call's chunks or a continuation's)."""
        config = self.transformer.config
        for start, end in bounds:
            served = self.transformer.chunk_layout_for(end - start, start)
            if served != (end - start,):
                raise ValueError(
                    f"`chunk_size={chunk_size}` cannot be served: its chunk of latent frames [{start}, {end}) would "
                    f"be split into causal chunks {served} by the transformer (its chunk_size={config.chunk_size}). "
                    f"Accepted: None (the transformer's {config.chunk_size}) or a size whose chunks stay under "
                    f"{2 * config.chunk_size} latent frames."
                )

    def encode_call_prompts(
        self,
        options: RolloutOptions,
        prompt: str | list[str] | None,
        prompt_embeds: torch.Tensor | None,
        prompt_schedule: Mapping[int, Any],
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor | None, dict[int, torch.Tensor]]:
        """[`encode_rollout_prompts`] of a call's first prompt and its schedule, with the call's negative prompt,
        guidance and sequence length."""
        return self.encode_rollout_prompts(
            prompt, options.negative_prompt, prompt_embeds, options.negative_prompt_embeds, prompt_schedule,
            options.guidance_scale, options.max_sequence_length, device,
        )  # fmt: skip

    def call_schedules(self, options: RolloutOptions) -> tuple[dict[str, list[float]], dict[str, list[float]] | None]:
        """The [`rollout_schedule`] of a call's chunks (its resolved steps, timesteps or sigmas) and of its first chunk
        (``None``: the same)."""
        schedule = self.rollout_schedule(options.num_inference_steps, options.timesteps, options.sigmas)
        first = options.first_chunk_timesteps
        return schedule, None if first is None else self.rollout_schedule(1, timesteps=first)

    def rollout_schedule(
        self,
        num_inference_steps: int,
        timesteps: Sequence[float] | None = None,
        sigmas: Sequence[float] | None = None,
    ) -> dict[str, list[float]]:
        """Arguments of ``scheduler.set_timesteps`` for every chunk.

        * Default: ``sigmas = [1, (N-1)/N, ..., 1/N]`` before the scheduler's shift (4 steps at shift 5 give the
          timesteps 1000, 937.5, 833.3, 625).
        * ``sigmas``: used as given, then shifted by the scheduler like diffusers does.
        * ``timesteps``: model-scale timesteps used as given; the matching sigmas ``t / 1000`` are passed unshifted
          (inverse of the shift) so that the update uses exactly ``sigma = t / 1000``.
        """
        if timesteps is not None:
            shift = self.scheduler.shift
            shifted = np.asarray(timesteps, dtype=np.float64) / self.scheduler.config.num_train_timesteps
            unshifted = shifted / (shift - (shift - 1.0) * shifted)
            return {"sigmas": unshifted.tolist(), "timesteps": [float(t) for t in timesteps]}
        if sigmas is not None:
            return {"sigmas": [float(s) for s in sigmas]}
        return {"sigmas": np.linspace(1.0, 0.0, num_inference_steps + 1)[:-1].tolist()}

    # ------------------------------------------------------------------ properties for callbacks
    @property
    def guidance_scale(self) -> float:
        return self._guidance_scale

    @property
    def do_classifier_free_guidance(self) -> bool:
        return self._guidance_scale > 1.0

    @property
    def num_timesteps(self) -> int:
        return self._num_timesteps

    @property
    def current_timestep(self) -> torch.Tensor | None:
        return self._current_timestep

    @property
    def interrupt(self) -> bool:
        return self._interrupt

    @property
    def attention_kwargs(self) -> dict[str, Any] | None:
        return self._attention_kwargs

    # ------------------------------------------------------------------ output
    def decode_latents(self, latents: torch.Tensor, output_type: str = "np"):
        """``(B, C, F, H, W)`` normalized latents to frames: ``"np"`` ``(B, 4F-3, H*8, W*8, 3)`` floats in [0, 1],
        ``"pt"`` ``(B, 4F-3, 3, H*8, W*8)``, ``"pil"`` lists of PIL images; ``"latent"`` returns ``latents``.

        Under context parallelism only the main process (rank 0 of the transformer's group) decodes; the others return
        ``latents`` without decoding (see :mod:`fastgen_diffusers.parallel`)."""
        if output_type == "latent" or not is_main_process(self.transformer):
            return latents
        vae = self.vae
        if not vae.use_tiling:  # frame by frame like `stream`, so that streamed and returned frames are identical
            with streaming_decoder(vae) as decoder:
                return self.video_processor.postprocess_video(decoder.decode(latents), output_type=output_type)
        latents = denormalize_latents(vae, latents.to(get_module_execution_device(vae), dtype=vae.dtype))
        video = vae.decode(latents, return_dict=False)[0]
        return self.video_processor.postprocess_video(video, output_type=output_type)
