"""A rollout session: the state of one causal rollout, from its first chunk to the last continuation.

The session owns the rollout's cache tags, its prompt embeddings and guidance, its context noise, its conditioner
and the history of finished chunks a policy or a continuation needs. It runs transformer forwards for a policy
(``forward``, ``store``), and edits its cache (``truncate``, ``fork``, ``discard``). A pipeline keeps the sessions of
its kept rollouts (``pipe(..., keep_cache=True)``); nothing of a call lives on the pipeline object.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch
from diffusers.utils.torch_utils import randn_tensor

from ...chunking import ChunkSpan
from .conditioning import Conditioner
from .prompt_switch import (
    ROPE_CUT_POSITION,
    STORE_ONLY,
    PromptSwitchRule,
    flush_caches,
    recache_keeping_sink,
    require_prefix_sinks,
    set_rope_cut,
)
from .records import ChunkRecord

MAIN_BRANCH = "main"


def branch_cache_tags(branch: str) -> tuple[str, str]:
    """``(conditional, unconditional)`` cache tags of a rollout branch: ``("pos", "neg")`` for ``"main"``."""
    return ("pos", "neg") if branch == MAIN_BRANCH else (f"{branch}/pos", f"{branch}/neg")


@dataclass(frozen=True)
class PromptTransition:
    """A prompt switch blended in linearly over ``num_chunks`` chunks (Krea's / scope's prompt interpolation).

    Chunk ``first_chunk + k`` (``k = 0 .. num_chunks - 1``) is conditioned on ``lerp(source, target, (k + 1) /
    num_chunks)`` (computed in float32, cast to the target's dtype), so the switch chunk already moves towards the
    new prompt and chunk ``first_chunk + num_chunks - 1`` reaches it; ``num_chunks=1`` is the hard switch. Krea's
    ``torch.linspace(0, 1, N)`` spends its first chunk at weight 0 (the old prompt) and never switches for ``N=1``:
    its ``N + 1`` is this ``N``, one chunk later.
    """

    source: torch.Tensor  # (B, L, text_dim): the prompt in use when the switch came (a blend, mid-transition)
    target: torch.Tensor  # (B, L, text_dim): the new prompt
    first_chunk: int
    num_chunks: int

    def weight_at(self, chunk_index: int) -> float:
        """The target's weight at ``chunk_index`` (1 from ``first_chunk + num_chunks - 1`` on)."""
        return min(1.0, (chunk_index - self.first_chunk + 1) / self.num_chunks)

    def embeds_at(self, chunk_index: int) -> torch.Tensor:
        weight = self.weight_at(chunk_index)
        if weight >= 1.0:
            return self.target
        return torch.lerp(self.source.float(), self.target.float(), weight).to(self.target.dtype)


def discard_branch(transformer: Any, branch: str) -> None:
    """Free the caches of both tags of ``branch`` in every engine of ``transformer``."""
    for engine in transformer.kv_cache_engines.values():
        for tag in branch_cache_tags(branch):
            engine.clear(tag)


def history_to_keep(keep_cache: bool, recaches: bool) -> bool | str:
    """A session's ``keep_history``: everything for a kept rollout, what a recache can use for a rollout with
    recached prompt switches, nothing otherwise."""
    return True if keep_cache else ("recache" if recaches else False)


class RolloutSession:
    """The state of one rollout branch and the transformer forwards it runs.

    Args:
        transformer: the causal transformer whose engines hold this session's caches.
        conditioner: the [`Conditioner`] of every chunk.
        prompt_embeds: ``(B, L, text_dim)`` embeddings of the conditional branch (the current prompt).
        negative_prompt_embeds: ``(B, L', text_dim)`` of the unconditional branch (``guidance_scale > 1``).
        guidance_scale: classifier-free guidance weight; above 1 the unconditional branch has its own cache tag.
        context_noise: timestep of the cache pass; above 0 a generated chunk is re-noised to it first.
        schedule: ``scheduler.set_timesteps`` arguments of the chunks (a continuation uses them).
        first_schedule: those of chunk 0 when it has its own (Causal Forcing++; a redo of chunk 0 uses them).
        attention_kwargs: passed to the transformer (``scale`` for LoRA).
        num_train_timesteps: the scheduler's, to turn ``context_noise`` into a sigma.
        branch: the rollout branch (``"main"``: tags ``"pos"`` / ``"neg"``).
        keep_history: what the session keeps of its finished chunks. ``True`` (a kept rollout): every chunk's latents
            (the video a continuation returns) and the cache inputs a recache can re-run (every chunk's without an
            attention window; under one, those of the chunks the window still holds, [`recache_chunks`]).
            ``"recache"`` (a rollout with recached prompt switches): only the chunks a recache can re-run, so a long
            windowed stream's memory stays flat. ``False``: no chunk tensors at all.
        num_reference_frames: leading latent frames that are not video frames (VACE's reference images).
        prompt_transition_chunks: a prompt switch is blended in over this many chunks ([`PromptTransition`]);
            0 or 1: the hard switch.
        switch_rule: what each prompt switch does to the caches ([`PromptSwitchRule`]: LongLive's kept sink at a
            recache, Infinity-RoPE's KV flush and scene cuts); the plain switch by default.
    """

    def __init__(
        self,
        transformer: Any,
        conditioner: Conditioner,
        *,
        prompt_embeds: torch.Tensor,
        negative_prompt_embeds: torch.Tensor | None,
        guidance_scale: float,
        context_noise: float,
        schedule: Mapping[str, Any],
        first_schedule: Mapping[str, Any] | None = None,
        attention_kwargs: dict[str, Any] | None = None,
        num_train_timesteps: int = 1000,
        branch: str = MAIN_BRANCH,
        keep_history: bool | str = True,
        num_reference_frames: int = 0,
        prompt_transition_chunks: int = 0,
        switch_rule: PromptSwitchRule | None = None,
    ) -> None:
        if keep_history not in (True, False, "recache"):
            raise ValueError(f"`keep_history` must be True, False or 'recache', got {keep_history!r}.")
        self.transformer = transformer
        self.conditioner = conditioner
        self.prompt_embeds = prompt_embeds
        self.negative_prompt_embeds = negative_prompt_embeds
        self.guidance_scale = guidance_scale
        self.context_noise = context_noise
        self.schedule = schedule
        self.first_schedule = first_schedule
        self.attention_kwargs = attention_kwargs
        self.num_train_timesteps = num_train_timesteps
        self.branch = branch
        self.keep_history = keep_history
        self.num_reference_frames = num_reference_frames
        self.prompt_transition_chunks = prompt_transition_chunks
        self.prompt_transition: PromptTransition | None = None  # a blended prompt switch under way
        self.switch_rule = switch_rule or PromptSwitchRule()  # what a prompt switch does to the caches
        self.rope_cut_chunk: int | None = None  # the chunk running at a scene cut's RoPE positions
        self.policy: Any = None  # the policy of the rollout (a continuation runs it again)
        tags = branch_cache_tags(branch)
        self.cache_tags: tuple[str, ...] = tags if guidance_scale > 1.0 else tags[:1]
        self.chunks: list[ChunkRecord] = []
        self.attention_bias = 1.0  # KV-cache attention bias of the denoising forwards (the call's, or its policy's)
        self.policy_state: Any = None  # what the running policy carries from chunk to chunk (policies hold none)
        self.num_latent_frames = 0  # one past the last stored frame
        self.num_chunks = 0

    # ------------------------------------------------------------------ history
    @property
    def latents(self) -> torch.Tensor:
        """``(B, C, F, H, W)`` clean latents of the whole rollout so far (a session with ``keep_history=True``)."""
        if self.keep_history is not True:
            raise RuntimeError(f"A session with keep_history={self.keep_history!r} does not hold the whole rollout.")
        return torch.cat([chunk.latents for chunk in self.chunks], dim=2)

    @property
    def video_latents(self) -> torch.Tensor:
        """[`latents`] without the leading reference frames: the frames of the video."""
        return self.latents[:, :, self.num_reference_frames :]

    def held_tensors(self) -> list[torch.Tensor]:
        """The chunk tensors the session holds (its history), each once, to account for memory (a chunk's cache
        input is its latents themselves when it was not re-noised)."""
        held = {id(t): t for chunk in self.chunks for t in (chunk.latents, chunk.context) if t is not None}
        return list(held.values())

    # ------------------------------------------------------------------ forwards
    def embeds_of(self, cache_tag: str) -> torch.Tensor:
        """The text embeddings of ``cache_tag``'s branch (conditional or unconditional)."""
        return self.prompt_embeds if cache_tag == self.cache_tags[0] else self.negative_prompt_embeds

    def forward(
        self,
        span: ChunkSpan,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        *,
        cache_tag: str,
        store_kv: bool,
        step: int = 0,
        call_options: Mapping[str, Any] | None = None,
    ) -> torch.Tensor:
        """One transformer forward of ``span``: ``(B, C, F, H, W)`` float32 latents to the flow prediction.

        ``call_options``: extra transformer keyword arguments a policy decides per forward (its own
        ``attention_window``, ``chunk_layout``)."""
        model_kwargs = {"hidden_states": latents, "encoder_hidden_states": self.embeds_of(cache_tag)}
        model_kwargs.update(
            self.conditioner.model_inputs(span, latents, cache_tag=cache_tag, store_kv=store_kv, step=step)
        )
        model_kwargs["hidden_states"] = model_kwargs["hidden_states"].to(self.transformer.dtype)
        if self.attention_bias != 1.0 and not store_kv:
            model_kwargs["kv_cache_attention_bias"] = self.attention_bias
        model_kwargs.update(call_options or {})
        return self.transformer(
            timestep=self.conditioner.timestep(span, timestep),
            start_frame=span.start,
            cache_tag=cache_tag,
            store_kv=store_kv,
            attention_kwargs=self.attention_kwargs,
            return_dict=False,
            **model_kwargs,
        )[0]

    def guided_flow(
        self,
        span: ChunkSpan,
        latents: torch.Tensor,
        timestep: torch.Tensor,
        step: int,
        call_options: Mapping[str, Any] | None = None,
    ) -> torch.Tensor:
        """The flow of a denoising forward, with classifier-free guidance when the session has an unconditional
        branch (``v_neg + g * (v - v_neg)``)."""
        options = {"step": step, "call_options": call_options}
        flow = self.forward(span, latents, timestep, cache_tag=self.cache_tags[0], store_kv=False, **options)
        if len(self.cache_tags) > 1:
            uncond_tag = self.cache_tags[1]
            flow_uncond = self.forward(span, latents, timestep, cache_tag=uncond_tag, store_kv=False, **options)
            flow = flow_uncond + self.guidance_scale * (flow - flow_uncond)
        return flow

    def context_timestep(self, batch_size: int, device: torch.device) -> torch.Tensor:
        return torch.full((batch_size,), float(self.context_noise), device=device)

    def store(
        self,
        span: ChunkSpan,
        clean: torch.Tensor,
        generator: torch.Generator | list[torch.Generator] | None,
    ) -> torch.Tensor:
        """Write the finished chunk into every cache tag (one ``store_kv`` forward each) and record it.

        A generated chunk is re-noised to ``context_noise`` first (drawing from ``generator``); a given chunk is
        written clean (its conditioner sets timestep 0). Returns the cache pass input.
        """
        context = clean
        if self.context_noise > 0 and self.conditioner.given_latents(span) is None:
            sigma = float(self.context_noise) / self.num_train_timesteps
            noise = randn_tensor(clean.shape, generator=generator, device=clean.device, dtype=clean.dtype)
            context = (1.0 - sigma) * clean + sigma * noise
        timestep = self.context_timestep(clean.shape[0], clean.device)
        for cache_tag in self.cache_tags:  # the prediction is not read: a store-only forward
            self.forward(span, context, timestep, cache_tag=cache_tag, store_kv=True, call_options=STORE_ONLY)
        self.record(span, clean, context)
        return context

    def record(self, span: ChunkSpan, clean: torch.Tensor, context: torch.Tensor | None) -> None:
        """Count a finished chunk; keep its tensors only when the session keeps its history, and then forget what no
        recache can use any more (the window evicted it; [`forget_evicted`])."""
        if self.keep_history:
            self.chunks.append(ChunkRecord(span.index, span.start, span.end, clean, context=context))
        self.num_latent_frames = span.end
        self.num_chunks = span.index + 1
        self.forget_evicted()

    def forget_evicted(self) -> None:
        """Drop from the history what a recache under the current window cannot re-run: the chunks past the sink
        whose frames the window has all evicted ([`recache_chunks`] never returns them again, as a window only
        moves forward). ``keep_history="recache"`` drops those chunks; ``True`` drops only their cache inputs and
        keeps their latents (the kept rollout's video). Nothing is dropped without a window."""
        if not self.keep_history:  # nothing held (a stream's session): no engine to ask, chunk after chunk
            return
        held = self._held_from()
        if held is None:
            return
        sink, evicted_before = held
        if self.keep_history == "recache":
            self.chunks = [c for c in self.chunks if c.start < sink or c.end > evicted_before]
        else:
            self.chunks = [
                c if c.start < sink or c.end > evicted_before or c.context is None else replace(c, context=None)
                for c in self.chunks
            ]

    def begin_chunk(self, chunk_index: int, switch: torch.Tensor | None, *, recache: bool) -> None:
        """Set the conditional prompt of chunk ``chunk_index`` before it runs: a prompt ``switch`` that takes effect
        there (blended in over ``prompt_transition_chunks`` chunks when that is above 1, starting from the prompt in
        use), or the next step of a blend under way; nothing otherwise. Each new prompt goes through
        [`switch_prompt`] (with ``recache``: a blend recaches at each of its chunks). A scene cut of the session's
        [`PromptSwitchRule`] puts the switch's chunk at the cut's RoPE positions, and the chunk after it back."""
        if self.rope_cut_chunk is not None and self.rope_cut_chunk != chunk_index:
            self.rope_cut_chunk = None
            set_rope_cut(self, None)
        if switch is not None and chunk_index in self.switch_rule.cut_chunks:
            self.rope_cut_chunk = chunk_index
            set_rope_cut(self, ROPE_CUT_POSITION)
        if switch is not None:
            self.prompt_transition = None
            if self.prompt_transition_chunks <= 1:
                self.switch_prompt(switch, recache=recache)
                return
            self.prompt_transition = PromptTransition(
                self.prompt_embeds, switch, chunk_index, self.prompt_transition_chunks
            )
        transition = self.prompt_transition
        if transition is None:
            return
        if transition.weight_at(chunk_index) >= 1.0:
            self.prompt_transition = None
        self.switch_prompt(transition.embeds_at(chunk_index), recache=recache)

    def switch_prompt(self, prompt_embeds: torch.Tensor, *, recache: bool) -> None:
        """Condition the conditional tag on ``prompt_embeds`` from the next chunk on.

        The tag's cross K/V are invalidated (the next forward refills them). With ``recache``, the chunks of the
        history run their cache pass again under the new prompt, in order (LongLive's recache): every chunk without
        an attention window, one forward each; under a window only the chunks the window still holds (the sink's
        and the most recent ones, [`recache_chunks`]), so a switch costs O(window) forwards, not O(video).
        """
        cache_tag = self.cache_tags[0]
        if recache and self.chunks:  # it keeps or re-runs the first frames as the sink: refused before any change
            require_prefix_sinks(self, cache_tag, "A recache")
        self.prompt_embeds = prompt_embeds
        for engine in self.transformer.kv_cache_engines.values():
            engine.invalidate_cross(cache_tag)
        if self.switch_rule.kv_flush:
            flush_caches(self)
        if not recache or not self.chunks:
            return
        timestep = self.context_timestep(prompt_embeds.shape[0], prompt_embeds.device)
        if self.switch_rule.recache_sink == "keep":
            recache_keeping_sink(self, timestep, cache_tag)
            return
        sink_chunks, recent_chunks = self.recache_chunks()
        if not recent_chunks:  # nothing evicted: every chunk, as without a window
            for chunk in sink_chunks:
                self._restore(chunk, timestep, cache_tag)
            return
        engines = [e for e in self.transformer.kv_cache_engines.values() if e.tag_state(cache_tag) is not None]
        sink_end = sink_chunks[-1].end if sink_chunks else 0
        for engine in engines:
            engine.truncate(cache_tag, sink_end)
        for chunk in sink_chunks:
            self._restore(chunk, timestep, cache_tag)
        try:
            for engine in engines:
                engine.skip_evicted(cache_tag, recent_chunks[0].start)
            for chunk in recent_chunks:
                self._restore(chunk, timestep, cache_tag)
        finally:
            for engine in engines:
                engine.end_recache(cache_tag)

    def recache_chunks(self) -> tuple[list[ChunkRecord], list[ChunkRecord]]:
        """The chunks a recache re-runs, as ``(first, recent)``: ``(every chunk, [])`` when the conditional tag
        still holds every frame (no window, or nothing evicted yet); else ``(sink chunks, recent chunks)``: the
        chunks holding a sink frame, and the later chunks holding a frame the window keeps (LongLive re-runs the
        last ``min(window, t)`` frames). The recent ones then see the sink and each other only: the frames
        before them are evicted, so their K/V past the first block differ from a full re-run's. The history holds
        no other chunk's cache input ([`forget_evicted`]).
        """
        held = self._held_from()
        if held is None:
            return list(self.chunks), []
        sink, evicted_before = held
        first = [chunk for chunk in self.chunks if chunk.start < sink]
        recent = [chunk for chunk in self.chunks if chunk.start >= sink and chunk.end > evicted_before]
        if len(first) + len(recent) == self.num_chunks:  # no chunk in between: every chunk, in order
            return list(self.chunks), []
        return first, recent

    def _held_from(self) -> tuple[int, int] | None:
        """``(sink, evicted_before)`` of the conditional tag when its window has evicted frames past the sink (the
        non-sink frames before ``evicted_before`` are gone); ``None`` when it still holds every stored frame. The
        sink is the first frames: only a recache reads this as which chunks to keep, and it refuses another sink
        rule ([`require_prefix_sinks`])."""
        cache_tag = self.cache_tags[0]
        sink, evicted_before = 0, 0
        for engine in self.transformer.kv_cache_engines.values():
            state = engine.tag_state(cache_tag)
            if engine.window.bounded and state is not None:
                sink = engine.window.sink
                evicted_before = max(evicted_before, min(state.evicted_before, state.num_frames))
        return None if evicted_before <= sink else (sink, evicted_before)

    def _restore(self, chunk: ChunkRecord, timestep: torch.Tensor, cache_tag: str) -> None:
        span = ChunkSpan(chunk.chunk_index, chunk.start, chunk.end)
        self.forward(span, chunk.context, timestep, cache_tag=cache_tag, store_kv=True, call_options=STORE_ONLY)

    # ------------------------------------------------------------------ cache edits
    def truncate(self, frame: int) -> None:
        """Forget every frame from ``frame`` on: the caches of the session's tags and the chunks of its history."""
        for engine in self.transformer.kv_cache_engines.values():
            for tag in self.cache_tags:
                engine.truncate(tag, frame)
        self.chunks = [chunk for chunk in self.chunks if chunk.end <= frame]
        if hasattr(self.policy_state, "rewind"):  # what a policy keeps of the chunks (recompute's context frames)
            self.policy_state = self.policy_state.rewind(frame)
        self.num_latent_frames = self.chunks[-1].end if self.chunks else 0
        self.num_chunks = self.chunks[-1].chunk_index + 1 if self.chunks else 0

    def fork(self, branch: str) -> RolloutSession:
        """A copy of this session on ``branch``: its caches copied under the new branch's tags (the static engine
        clones its buffers, the vanilla engine shares the stored tensors until a branch writes), the history and the
        conditioner shared (neither is written in place)."""
        forked = RolloutSession.__new__(RolloutSession)
        forked.__dict__.update(self.__dict__)
        forked.branch = branch
        forked.cache_tags = branch_cache_tags(branch)[: len(self.cache_tags)]
        forked.chunks = list(self.chunks)
        if hasattr(self.policy_state, "fork"):
            forked.policy_state = self.policy_state.fork()
        for engine in self.transformer.kv_cache_engines.values():
            for source_tag, target_tag in zip(self.cache_tags, forked.cache_tags):
                if engine.tag_state(source_tag) is not None:
                    engine.copy_tag(source_tag, target_tag)
        return forked

    def discard(self) -> None:
        """Free the caches of the session's branch (both tags)."""
        discard_branch(self.transformer, self.branch)
