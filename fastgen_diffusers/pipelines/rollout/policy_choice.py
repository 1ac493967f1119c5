"""Which [`RolloutPolicy`] runs a call: the pipeline's default (chunk by chunk), or the one the call's policy settings
name (Krea's recompute, Rolling Forcing's rolling window), and which pipelines can run which.

The policies' settings, names and rules live in the registry (:mod:`fastgen_diffusers.settings.policies`); here each
registered settings class is mapped to the runtime policy that runs it (:data:`POLICY_RUNNERS`,
:func:`register_policy_runner`). [`PolicyChoiceMixin`] is a layer of [`CausalRolloutMixin`] (the host provides
``transformer``, ``default_policy``, ``recompute_policy_class`` and ``conditions_chunks``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from ...settings import POLICIES, PolicySettings, RecomputeSettings, RollingSettings, SequentialSettings
from .options import RolloutOptions
from .policy import RolloutPolicy, SequentialPolicy
from .policy_rolling import RollingPolicy

# settings class -> (pipeline, resolved options) -> the runtime policy, or None when the pipeline cannot run it
PolicyRunner = Callable[[Any, RolloutOptions], "RolloutPolicy | None"]
POLICY_RUNNERS: dict[type[PolicySettings], PolicyRunner] = {}


def register_policy_runner(settings_class: type[PolicySettings]) -> Callable[[PolicyRunner], PolicyRunner]:
    """Decorator: the function that builds the runtime policy of ``settings_class`` for a pipeline."""

    def decorate(runner: PolicyRunner) -> PolicyRunner:
        POLICY_RUNNERS[settings_class] = runner
        return runner

    return decorate


@register_policy_runner(SequentialSettings)
def _sequential(pipe: Any, options: RolloutOptions | None) -> RolloutPolicy:
    return pipe.default_policy


@register_policy_runner(RecomputeSettings)
def _recompute(pipe: Any, options: RolloutOptions | None) -> RolloutPolicy | None:
    if pipe.recompute_policy_class is None:
        return None
    if options is None:
        return pipe.default_policy  # a capability query: the pipeline has a recompute policy
    policy = options.settings.policy
    bias = 1.0 if options.kv_cache_attention_bias is None else float(options.kv_cache_attention_bias)
    return pipe.recompute_policy_class(
        policy.context_frames,
        keep_first_frame=bool(policy.keep_first_frame),
        kv_cache_attention_bias=bias,
        output_frames=options.output_type != "latent",
    )


@register_policy_runner(RollingSettings)
def _rolling(pipe: Any, options: RolloutOptions | None) -> RolloutPolicy:
    return RollingPolicy(None if options is None else options.attention_window)


def _policy_class(policy: str | type[PolicySettings] | PolicySettings | None) -> type[PolicySettings]:
    if isinstance(policy, PolicySettings):
        return type(policy)
    if isinstance(policy, type):
        return policy
    return POLICIES[policy or SequentialSettings.name]


class PolicyChoiceMixin:
    """Choose the policy of a call (see the module docstring)."""

    def select_policy(self, options: RolloutOptions) -> RolloutPolicy:
        """The [`RolloutPolicy`] that runs a call with resolved ``options`` (``resolve_options``): the one its policy
        settings name (e.g. a [`RecomputePolicy`] over ``context_frames`` with ``kv_cache_attention_bias``, a
        [`RollingPolicy`] attending to ``attention_window`` frames per forward), or the pipeline's
        ``default_policy``."""
        settings = getattr(options, "settings", None)
        policy = None if settings is None else settings.policy
        if policy is None or not self.supports_policy(policy):
            return self.default_policy
        return POLICY_RUNNERS[type(policy)](self, options)

    def supports_policy(self, kv_cache_policy: str | type[PolicySettings] | PolicySettings | None) -> bool:
        """Whether this pipeline can run ``kv_cache_policy`` (a name, or its settings; ``None``: always): a policy
        that reads no per-frame conditioning ([`PolicySettings.serves_conditioned_chunks`]) needs a pipeline
        conditioned on text alone, one that replaces the chunk-by-chunk loop a pipeline whose default is it, and every
        one a runner ([`register_policy_runner`]) that builds it here."""
        cls = _policy_class(kv_cache_policy)
        if not cls.runs_on(self.conditions_chunks(), type(self.default_policy) is SequentialPolicy):
            return False
        runner = POLICY_RUNNERS.get(cls)
        return runner is not None and runner(self, None) is not None

    def supports_recompute(self) -> bool:
        """Whether Krea's recompute policy can drive this pipeline's rollouts (chunks conditioned on text alone)."""
        return self.supports_policy(RecomputeSettings)

    def supports_rolling(self) -> bool:
        """Whether Rolling Forcing's rolling policy can drive this pipeline's rollouts (text-to-video ones)."""
        return self.supports_policy(RollingSettings)

    def supports_attention_bias(self) -> bool:
        """Whether the transformer takes ``kv_cache_attention_bias`` (every causal Wan transformer here does; a custom
        one may not)."""
        transformer = getattr(self, "transformer", None)
        if transformer is None:
            return False
        return "kv_cache_attention_bias" in inspect.signature(type(transformer).forward).parameters

    def supported_policies(self) -> tuple[str | None, ...]:
        """The ``kv_cache_policy`` values this pipeline accepts."""
        return (None, *(name for name in POLICIES if self.supports_policy(name)))

    def check_policy_inputs(self, kv_cache_policy: str | None, kv_cache_attention_bias: float | None) -> None:
        """Raise ``ValueError`` (before the call's settings are built) for a policy this pipeline cannot run, or an
        attention bias its transformer cannot take. Every other rule of the call's settings is checked when they are
        built."""
        if kv_cache_policy in POLICIES and not self.supports_policy(kv_cache_policy):
            sequential_default = type(self.default_policy) is SequentialPolicy
            POLICIES[kv_cache_policy].check_runs_on(type(self).__name__, self.conditions_chunks(), sequential_default)
            raise ValueError(  # the policy runs on such a pipeline, but this one has no runner for it
                f"`kv_cache_policy={kv_cache_policy!r}` has no runner on {type(self).__name__}. Accepted here: "
                f"{self.supported_policies()}."
            )
        bias = kv_cache_attention_bias
        if bias is not None and bias != 1 and not self.supports_attention_bias():
            raise ValueError(
                f"`kv_cache_attention_bias={bias!r}` is not supported by {type(self).__name__}: its transformer "
                f"({type(self.transformer).__name__}) takes no attention bias. Accepted here: None or 1."
            )

    def check_rolling_rollout(
        self,
        options: RolloutOptions,
        bounds: Sequence[tuple[int, int]],
        num_levels: int,
        policy: RolloutPolicy | None = None,
    ) -> RollingPolicy | None:
        """The [`RollingPolicy`] of a call whose policy is the rolling one (``None`` for any other), once the pipeline
        and the chunking are checked to suit it (``ValueError`` before any work otherwise). ``policy``: the call's
        [`select_policy`], when the caller has it already."""
        policy = self.select_policy(options) if policy is None else policy
        if not isinstance(policy, RollingPolicy):
            return None
        options.settings.active_policy.check_chunks(bounds, num_levels, self.transformer.config.rope_max_seq_len)
        policy.check_plan(list(bounds), num_levels)
        if options.kv_cache_engine is None:
            policy.check_engines(self.transformer, bounds[0][1] - bounds[0][0])
        return policy
