"""Which [`RolloutPolicy`] runs a call: the pipeline's default (chunk by chunk), Krea's recompute or Rolling
Forcing's rolling window (``kv_cache_policy``), which pipelines can run which, and the checks of a policy's options
against each other and the KV-cache options (before any work).

[`PolicyChoiceMixin`] is a layer of [`CausalRolloutMixin`] (the host provides ``transformer``, ``default_policy``,
``recompute_policy_class``, ``conditions_chunks`` and [`KVCacheOptionsMixin.check_kv_cache_inputs`]).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from .kv_cache_options import kv_cache_position_options
from .options import RolloutOptions
from .policy import RolloutPolicy, SequentialPolicy
from .policy_recompute import KV_CACHE_POLICIES, RECOMPUTE, check_recompute_inputs
from .policy_rolling import ROLLING, RollingPolicy, check_rolling_inputs


class PolicyChoiceMixin:
    """Choose and check a call's rollout policy (see the module docstring)."""

    def select_policy(self, options: RolloutOptions) -> RolloutPolicy:
        """The [`RolloutPolicy`] that runs a call: the pipeline's ``default_policy`` (a policy option of the call,
        e.g. a recompute or rolling-window policy, is resolved here): ``kv_cache_policy="recompute"`` gives a
        [`RecomputePolicy`] over ``context_frames`` with ``kv_cache_attention_bias``, ``kv_cache_policy="rolling"`` a
        [`RollingPolicy`] attending to ``attention_window`` frames per forward. A policy the pipeline cannot run is
        refused before any work ([`check_policy_inputs`])."""
        policy = getattr(options, "kv_cache_policy", None)
        if policy == RECOMPUTE and self.supports_recompute():
            bias = 1.0 if options.kv_cache_attention_bias is None else float(options.kv_cache_attention_bias)
            return self.recompute_policy_class(
                options.context_frames,
                keep_first_frame=bool(getattr(options, "keep_first_frame", False)),
                kv_cache_attention_bias=bias,
                output_frames=options.output_type != "latent",
            )
        if policy == ROLLING and self.supports_rolling():
            return RollingPolicy(options.attention_window)
        return self.default_policy

    def supports_rolling(self) -> bool:
        """Whether ``kv_cache_policy="rolling"`` can drive this pipeline's rollouts: text-to-video ones (chunks
        conditioned on text alone, sampled by the sequential default policy)."""
        return not self.conditions_chunks() and type(self.default_policy) is SequentialPolicy

    def supports_recompute(self) -> bool:
        """Whether ``kv_cache_policy="recompute"`` can drive this pipeline's rollouts: chunks conditioned on text
        alone (text-to-video, video-to-video). The recompute policy runs a chunk's forwards at the positions right
        after its context, not at its frames, so conditioning read by frame (image, control video) would be
        misplaced."""
        return self.recompute_policy_class is not None and not self.conditions_chunks()

    def supports_policy(self, kv_cache_policy: str | None) -> bool:
        """Whether this pipeline can run ``kv_cache_policy`` (``None`` and ``"sequential"``: always)."""
        if kv_cache_policy == ROLLING:
            return self.supports_rolling()
        if kv_cache_policy == RECOMPUTE:
            return self.supports_recompute()
        return True

    def supports_attention_bias(self) -> bool:
        """Whether the transformer takes ``kv_cache_attention_bias`` (every causal Wan transformer here does; a custom
        one may not)."""
        transformer = getattr(self, "transformer", None)
        if transformer is None:
            return False
        return "kv_cache_attention_bias" in inspect.signature(type(transformer).forward).parameters

    def supported_policies(self) -> tuple[str | None, ...]:
        """The ``kv_cache_policy`` values this pipeline accepts."""
        return (None, *(policy for policy in KV_CACHE_POLICIES if self.supports_policy(policy)))

    def check_policy_inputs(self, options: RolloutOptions, prompt_schedule: Mapping[int, Any] | None) -> None:
        """Raise ``ValueError`` (before any work) for a ``kv_cache_policy`` this pipeline cannot run, or policy and
        KV-cache options that do not go together: the policies' checks first (so that the message names the
        policy), then the engines' ([`check_kv_cache_inputs`])."""
        policy = options.kv_cache_policy
        if policy in KV_CACHE_POLICIES and not self.supports_policy(policy):
            kind = "conditions its chunks by frame" if self.conditions_chunks() else "samples chunk by chunk"
            raise ValueError(
                f"`kv_cache_policy={policy!r}` drives text-to-video rollouts only (and video-to-video ones under "
                f"'recompute'); {type(self).__name__} {kind}. Accepted here: {self.supported_policies()}."
            )
        bias = options.kv_cache_attention_bias
        if bias is not None and bias != 1 and not self.supports_attention_bias():
            raise ValueError(
                f"`kv_cache_attention_bias={bias!r}` is not supported by {type(self).__name__}: its transformer "
                f"({type(self.transformer).__name__}) takes no attention bias. Accepted here: None or 1."
            )
        check_recompute_inputs(
            policy, options.context_frames, options.attention_window, options.sink_frames, options.keep_cache,
            options.recache, options.kv_cache_attention_bias, options.keep_first_frame,
            rope_positions=options.rope_positions, sink_update=options.sink_update,
        )  # fmt: skip
        check_rolling_inputs(
            policy, attention_window=options.attention_window, sink_frames=options.sink_frames,
            keep_cache=options.keep_cache, recache=options.recache, context_noise=options.context_noise,
            first_chunk_timesteps=options.first_chunk_timesteps, prompt_schedule=prompt_schedule,
            rope_positions=options.rope_positions, sink_update=options.sink_update,
        )  # fmt: skip
        self.check_kv_cache_inputs(
            options.kv_cache_engine,
            options.attention_window,
            options.sink_frames,
            **kv_cache_position_options(options),
            kv_cache_dtype=options.kv_cache_dtype,
        )

    def check_rolling_rollout(
        self, options: RolloutOptions, bounds: Sequence[tuple[int, int]], num_levels: int
    ) -> RollingPolicy | None:
        """The [`RollingPolicy`] of a ``kv_cache_policy="rolling"`` call (``None`` for any other), once the pipeline
        and the chunking are checked to suit it (``ValueError`` before any work otherwise)."""
        if options.kv_cache_policy != ROLLING:
            return None
        table = self.transformer.config.rope_max_seq_len
        if bounds[-1][1] > table:
            raise ValueError(
                f"`kv_cache_policy='rolling'` keeps absolute RoPE positions (only the anchor moves), so it serves at "
                f"most {table} latent frames (`rope_max_seq_len`), got {bounds[-1][1]}; RoPE re-basing does not apply "
                "to its keys, which are stored before RoPE. Ask for fewer `num_frames`."
            )
        policy = RollingPolicy(options.attention_window)
        policy.check_plan(list(bounds), num_levels)
        if options.kv_cache_engine is None:
            policy.check_engines(self.transformer, bounds[0][1] - bounds[0][0])
        return policy
