"""Krea's KV-cache recompute policy and attention bias (issue #14, parts 1 and 2) against the recorded reference of
scope's Krea sampler (``tests/data/krea_tiny``, see its README), and through the pipeline.

* Unbiased: the recorded noise and re-noise draws driven through [`RecomputePolicy`] (a stand-in scheduler applies
  upstream's grid sigmas and recorded draws; the recorded re-encoded anchors are fed through ``anchor=``) reproduce
  every recorded call and the final latents.
* Biased: every biased call replayed with ``kv_cache_attention_bias=0.3`` matches ``flow_pred_nopad`` (the exact
  bias, without upstream's padding artefact); the free run matches ``biased_nopad`` on the chunks before the first
  re-encoded anchor.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fastgen_diffusers import WanCausalTransformer3DModel
from fastgen_diffusers.chunking import ChunkPlan
from fastgen_diffusers.pipelines.rollout.conditioning import Conditioner
from fastgen_diffusers.pipelines.rollout.policy_recompute import RecomputePolicy
from fastgen_diffusers.pipelines.rollout.session import RolloutSession
from fastgen_diffusers.pipelines.rollout.sources import NoiseSource
from fastgen_diffusers.testing import PolicyHost, tiny_pipeline

REFERENCE = Path(__file__).resolve().parent / "data" / "krea_tiny"
CHUNKS, CHUNK_FRAMES, CONTEXT_FRAMES, STEPS = 4, 3, 3, (1000.0, 750.0, 500.0, 250.0)


@pytest.fixture(scope="module")
def reference():
    meta = json.loads((REFERENCE / "meta.json").read_text())
    inputs = load_file(REFERENCE / "inputs.safetensors")
    outputs = load_file(REFERENCE / "outputs.safetensors")
    model = WanCausalTransformer3DModel.from_pretrained(REFERENCE / "transformer", chunk_size=CHUNK_FRAMES).eval()
    return meta, inputs, outputs, model


def layout(x: torch.Tensor) -> torch.Tensor:
    """``[B, F, C, H, W]`` <-> ``[B, C, F, H, W]``."""
    return x.permute(0, 2, 1, 3, 4)


def grid_sigma(t: float) -> float:
    sigmas = torch.linspace(1.0, 0.0, 1001, dtype=torch.float32)[:-1]
    sigmas = 5.0 * sigmas / (1 + 4.0 * sigmas)
    return float(sigmas[torch.argmin((sigmas * 1000 - t).abs())])


class RecordedScheduler:
    """Upstream's sampler: timesteps [1000, 750, 500, 250], x0 with the grid sigma in float64, re-noise with the
    recorded draws of ``variant`` (chunk by chunk, in the order ``set_timesteps`` is called)."""

    def __init__(self, inputs, variant: str):
        self.inputs, self.variant, self.chunk = inputs, variant, -1

    def set_timesteps(self, **_):
        self.chunk, self.index, self.timesteps = self.chunk + 1, 0, torch.tensor(STEPS)

    def set_begin_index(self, index):
        pass

    def step(self, flow, t, x, generator=None, return_dict=False):
        x0 = (x.double() - grid_sigma(float(t)) * flow.double()).float()
        if self.index + 1 < len(STEPS):
            sigma = grid_sigma(STEPS[self.index + 1])
            eps = layout(self.inputs[f"{self.variant}.chunk{self.chunk}.step{self.index}.renoise_noise"])
            x0 = (1 - sigma) * x0 + sigma * eps
        self.index += 1
        return (x0,)


def run_policy(reference, variant: str, noise_variant: str, bias: float, anchors: bool = True):
    """Drive a [`RecomputePolicy`] over the reference's 4 chunks; returns (calls, final latents, cache bytes)."""
    meta, inputs, outputs, model = reference
    model.clear_caches()
    session = RolloutSession(
        model, Conditioner(), prompt_embeds=inputs["prompt_embeds"], negative_prompt_embeds=None,
        guidance_scale=1.0, context_noise=0.0, schedule={}, keep_history=False,
    )  # fmt: skip
    noise = torch.cat([layout(outputs[f"{noise_variant}.chunk{c}.step0.hidden_states"]) for c in range(CHUNKS)], 2)
    bounds = [(3 * c, 3 * c + 3) for c in range(CHUNKS)]
    plan = ChunkPlan.from_bounds(bounds, {"sigmas": [1.0, 0.75, 0.5, 0.25]})
    anchor = (lambda c, state: layout(outputs[f"{variant}.chunk{c}.anchor.latent"])) if anchors else None
    policy = RecomputePolicy(CONTEXT_FRAMES, anchor=anchor, keep_first_frame=not anchors, kv_cache_attention_bias=bias)
    calls, cache_bytes, latents = [], [], []
    forward = model.forward

    def recording(*args, **kwargs):
        out = forward(*args, **kwargs)
        calls.append((kwargs["start_frame"], kwargs["store_kv"], out[0]))
        return out

    model.forward = recording
    try:
        with torch.no_grad():
            pipe = PolicyHost(RecordedScheduler(inputs, noise_variant))
            for chunk in policy.run(pipe, session, plan, NoiseSource(noise)):
                latents.append(chunk.latents)
                cache_bytes.append(model.kv_cache_bytes())
    finally:
        del model.forward
        model.clear_caches()
    return calls, torch.cat(latents, 2), cache_bytes


def test_unbiased_recompute_policy_reproduces_every_call_and_the_final_latents(reference):
    meta, _, outputs, _ = reference
    calls, final, cache_bytes = run_policy(reference, "unbiased", "unbiased", 1.0)
    recorded = meta["variants"]["unbiased"]["calls"]
    assert len(calls) == len(recorded)
    # the recompute passes are store-only (no prediction): what they store is read by every later call
    assert [out is None for *_, out in calls] == [call["recompute"] for call in recorded]
    worst = 0.0
    for call, (start_frame, store_kv, out) in zip(recorded, calls):
        assert (start_frame, store_kv) == (call["replay_start_frame"], call["replay_store_kv"])
        if out is None:
            continue
        worst = max(worst, (layout(out) - outputs[f"{call['name']}.flow_pred"]).abs().max().item())
    assert worst <= 1e-5, worst
    error = (layout(final) - outputs["unbiased.final_latents"]).abs().max().item()
    assert error <= 1e-5, error
    # the cache holds exactly the context after every chunk but the first (which stores nothing)
    frame_bytes = cache_bytes[1] // CONTEXT_FRAMES
    assert cache_bytes[0] == 0 and cache_bytes[1:] == [CONTEXT_FRAMES * frame_bytes] * (CHUNKS - 1)


def test_keep_first_frame_matches_until_the_anchor_leaves(reference):
    """Without the re-encoded anchor, the first latent frame stays the anchor: chunks 0 and 1 are upstream's."""
    _, _, outputs, _ = reference
    _, final, _ = run_policy(reference, "unbiased", "unbiased", 1.0, anchors=False)
    reference_final = layout(outputs["unbiased.final_latents"])
    assert (final[:, :, :6] - reference_final[:, :, :6]).abs().max().item() <= 1e-5
    assert (final[:, :, 6:] - reference_final[:, :, 6:]).abs().max().item() > 1e-3


@torch.no_grad()
def test_biased_calls_match_the_exact_bias(reference):
    """Every biased call with upstream's inputs and cache: our bias == ``flow_pred_nopad`` (no padding artefact)."""
    meta, inputs, outputs, model = reference
    prompt = inputs["prompt_embeds"]
    worst, padded = 0.0, 0.0
    for call in meta["variants"]["biased"]["calls"]:
        if call["recompute"] or call["chunk"] == 0 and call["name"].endswith("step0"):
            model.clear_caches()
        x = layout(outputs[f"{call['name']}.hidden_states"])
        bias = call["kv_cache_attention_bias"]
        out = model(
            x, torch.tensor([call["timestep"]]), prompt, start_frame=call["replay_start_frame"],
            store_kv=call["replay_store_kv"], kv_cache_attention_bias=bias, return_dict=False,
        )[0]  # fmt: skip
        name = f"{call['name']}.flow_pred_nopad" if not call["recompute"] else f"{call['name']}.flow_pred"
        worst = max(worst, (layout(out) - outputs[name]).abs().max().item())
        if not call["recompute"]:
            padded = max(padded, (layout(out) - outputs[f"{call['name']}.flow_pred"]).abs().max().item())
            if call["chunk"] >= 1:  # the bias changes the output (nothing to bias in chunk 0)
                unbiased = model(
                    x, torch.tensor([call["timestep"]]), prompt, start_frame=call["replay_start_frame"],
                    return_dict=False,
                )[0]  # fmt: skip
                assert (unbiased - out).abs().max().item() > 1e-3
    model.clear_caches()
    assert worst <= 1e-5, worst
    assert padded > 1e-2  # upstream's padding artefact, which we do not reproduce


def test_biased_free_run_matches_biased_nopad_before_the_reencoded_anchor(reference):
    _, _, outputs, _ = reference
    # biased_nopad draws the same noise as unbiased (same seeds); its anchors are not recorded: chunks 0 and 1
    _, final, _ = run_policy(reference, "unbiased", "unbiased", 0.3, anchors=False)
    target = layout(outputs["biased_nopad.final_latents"])
    assert (final[:, :, :6] - target[:, :, :6]).abs().max().item() <= 1e-5


@torch.no_grad()
def test_bias_one_is_no_bias_exactly(reference):
    _, inputs, outputs, model = reference
    prompt = inputs["prompt_embeds"]
    model.clear_caches()
    context = layout(outputs["unbiased.chunk2.recompute.hidden_states"])
    model(context, torch.zeros(1, 3), prompt, start_frame=0, store_kv=True, return_dict=False)
    x = layout(outputs["unbiased.chunk2.step1.hidden_states"])
    t = torch.full((1, 3), 750.0)
    plain = model(x, t, prompt, start_frame=3, return_dict=False)[0]
    one = model(x, t, prompt, start_frame=3, kv_cache_attention_bias=1.0, return_dict=False)[0]
    model.clear_caches()
    assert torch.equal(plain, one)


# ---------------------------------------------------------------------------------------------- through the pipeline
CALL = {"prompt": "a cat", "height": 16, "width": 16, "num_frames": 45, "num_inference_steps": 2}


@pytest.fixture(scope="module")
def pipe():
    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _latents(pipe, **kwargs):
    kwargs = CALL | {"output_type": "latent"} | kwargs
    return pipe(generator=torch.Generator().manual_seed(0), **kwargs).frames


@pytest.mark.parametrize("bias", [None, 0.3])
def test_pipeline_recompute_is_engine_agnostic_and_bounded(pipe, bias):
    tables = []  # (start_frame, frames) of every forward: RoPE positions (no re-basing offset here)
    forward = pipe.transformer.forward

    def recording(hidden_states, *args, **kwargs):
        tables.append((kwargs["start_frame"], hidden_states.shape[2]))
        return forward(hidden_states, *args, **kwargs)

    pipe.transformer.forward = recording
    try:
        options = {"kv_cache_policy": "recompute", "context_frames": 3, "kv_cache_attention_bias": bias}
        static = _latents(pipe, **options)
        vanilla = _latents(pipe, kv_cache_engine="vanilla", **options)
    finally:
        del pipe.transformer.forward
    torch.testing.assert_close(static, vanilla, rtol=0, atol=1e-5)
    assert max(start + n for start, n in tables) <= 3 + 3  # positions below context_frames + chunk
    sequential = _latents(pipe)
    # with context 3 = chunk 3 and no context noise, chunks 0 and 1 see exactly the sequential cache
    if bias is None:
        torch.testing.assert_close(static[:, :, :6], sequential[:, :, :6], rtol=0, atol=1e-5)
    assert (static[:, :, 6:] - sequential[:, :, 6:]).abs().max().item() > 1e-4


def test_stream_recompute_cache_stays_at_the_context(pipe):
    sizes = []
    stream = pipe.stream(
        generator=torch.Generator().manual_seed(0), kv_cache_engine="vanilla", kv_cache_policy="recompute",
        context_frames=2, output_type="latent", **{**CALL, "num_frames": 61},
    )  # fmt: skip
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        sizes.append(pipe.transformer.kv_cache_bytes())
    assert [c.end - c.start for c in chunks] == [4, 3, 3, 3, 3]  # the first chunk absorbs the remainder
    assert sizes[0] == 0 and len(set(sizes[1:])) == 1 and sizes[1] > 0
    stored = _latents(pipe, kv_cache_policy="recompute", context_frames=2, num_frames=61)
    torch.testing.assert_close(torch.cat([c.latents for c in chunks], 2), stored, rtol=0, atol=1e-5)


def test_one_policy_object_serves_interleaved_rollouts():
    """A policy holds no per-rollout state (the context frames live on the session): two pipelines sharing one
    `RecomputePolicy` and streaming in turn give what each gives alone."""
    policy = RecomputePolicy(2, kv_cache_attention_bias=0.5)
    call = {**CALL, "num_frames": 61, "output_type": "latent", "kv_cache_policy": "recompute", "context_frames": 2}
    pipes = [tiny_pipeline(seed) for seed in (0, 1)]
    for p in pipes:
        p.set_progress_bar_config(disable=True)
        p.select_policy = lambda options: policy  # a pipeline subclass's select_policy returning one shared object

    def stream(p, seed):
        return p.stream(generator=torch.Generator().manual_seed(seed), **call)

    alone = [torch.cat([c.latents for c in stream(p, seed)], 2) for seed, p in enumerate(pipes)]
    streams = [stream(p, seed) for seed, p in enumerate(pipes)]
    chunks = [[], []]
    for pair in zip(*streams):  # chunk 0 of each, then chunk 1 of each, ...
        for index, chunk in enumerate(pair):
            chunks[index].append(chunk.latents)
    for index in range(2):
        assert torch.equal(torch.cat(chunks[index], 2), alone[index])
    assert set(vars(policy)) == {
        "context_frames",
        "keep_first_frame",
        "anchor",
        "kv_cache_attention_bias",
        "output_frames",
    }


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kv_cache_policy": "bogus"}, "kv_cache_policy"),
        ({"kv_cache_policy": "recompute"}, "context_frames"),
        ({"kv_cache_policy": "recompute", "context_frames": 0}, "context_frames"),
        ({"context_frames": 3}, "context_frames"),
        ({"kv_cache_policy": "recompute", "context_frames": 3, "attention_window": 6}, "attention_window"),
        ({"kv_cache_policy": "recompute", "context_frames": 3, "recache": True}, "recache"),
        ({"keep_first_frame": True}, "keep_first_frame"),
        ({"kv_cache_policy": "recompute", "context_frames": 3, "keep_first_frame": 1}, "keep_first_frame"),
        ({"kv_cache_policy": "recompute", "context_frames": 3, "kv_cache_attention_bias": 0.0}, "bias"),
        ({"kv_cache_policy": "recompute", "context_frames": 3, "kv_cache_attention_bias": 1.5}, "bias"),
    ],
)
def test_bad_recompute_arguments_raise(pipe, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _latents(pipe, **kwargs)


def test_stored_config_defaults(pipe):
    """A pipeline config holding the recompute settings (a converted Krea student) fills what a call leaves out."""
    from fastgen_diffusers import WanCausalPipeline
    from fastgen_diffusers.pipelines.rollout.options import RolloutOptions

    stored = {"kv_cache_policy": "recompute", "context_frames": 3, "kv_cache_attention_bias": 0.3}
    host = WanCausalPipeline(**pipe.components, **stored)
    resolved = host.resolve_options(RolloutOptions(prompt="a"))
    assert resolved.kv_cache_policy == "recompute"
    assert (resolved.context_frames, resolved.kv_cache_attention_bias) == (3, 0.3)
    policy = host.select_policy(resolved)
    assert isinstance(policy, RecomputePolicy) and policy.context_frames == 3 and policy.kv_cache_attention_bias == 0.3
    call = RolloutOptions(prompt="a", context_frames=5, kv_cache_attention_bias=1.0)
    resolved = host.resolve_options(call)
    assert (resolved.context_frames, resolved.kv_cache_attention_bias) == (5, 1.0)  # the call's own values win
    # no stored settings: the sequential default
    plain = pipe.resolve_options(RolloutOptions(prompt="a"))
    assert plain.kv_cache_policy is None and pipe.select_policy(plain) is pipe.default_policy


# ------------------------------------------------------------------ upstream's padding artefact, accounted for
class UpstreamPadding:
    """Upstream's biased path: q/k/v zero-padded to a multiple of 128 tokens *without a mask*, so every padded key
    joins the softmax with logit 0 and value 0. Applied to the self-attention of the denoising forwards (``active``)
    through both attention entry points of our processor; cache passes pad too upstream but mask the pads (exact), so
    they are left as they are. Records the zero keys it added per self-attention."""

    def __init__(self, model, monkeypatch):
        from fastgen_diffusers.processors import attention as attention_module

        self.active, self.inside, self.zero_keys = False, False, []
        plain, masked = attention_module.dispatch_attention_fn, attention_module.masked_attention

        def dispatch(query, key, value, *args, **kwargs):
            if self.active and self.inside:
                return self.padded(query, key, value)
            return plain(query, key, value, *args, **kwargs)

        def masked_or_biased(query, key, value, mask, bias=None):
            if self.active and self.inside:
                return self.padded(query, key, value, mask, bias)
            return masked(query, key, value, mask, bias)

        monkeypatch.setattr(attention_module, "dispatch_attention_fn", dispatch)
        monkeypatch.setattr(attention_module, "masked_attention", masked_or_biased)
        self.handles = []
        for block in model.blocks:  # self-attention only (cross-attention goes through `dispatch_attention_fn` too)
            self.handles.append(block.attn1.register_forward_pre_hook(lambda *args: setattr(self, "inside", True)))
            self.handles.append(block.attn1.register_forward_hook(lambda *args: setattr(self, "inside", False)))

    def remove_hooks(self):
        for handle in self.handles:
            handle.remove()

    def padded(self, query, key, value, mask=None, bias=None):
        query, key, value = (t.transpose(1, 2) for t in (query, key, value))  # (B, H, L, D)
        length = key.shape[2]
        pad = -(-length // 128) * 128 - length
        self.zero_keys.append(pad)
        additive = torch.zeros(1, 1, 1, length, dtype=query.dtype) if bias is None else bias.dense().to(query.dtype)
        if mask is not None:  # the SDPA backend's additive float mask (the bias; one chunk masks nothing)
            assert isinstance(mask, torch.Tensor) and mask.dtype != torch.bool
            additive = additive + mask.to(query.dtype)
        additive = torch.cat([additive, additive.new_zeros(*additive.shape[:-1], pad)], dim=-1)
        zeros = key.new_zeros(*key.shape[:2], pad, key.shape[3])
        out = torch.nn.functional.scaled_dot_product_attention(
            query, torch.cat([key, zeros], 2), torch.cat([value, zeros], 2), attn_mask=additive
        )
        return out.transpose(1, 2)


@torch.no_grad()
def test_biased_calls_with_upstreams_zero_key_padding_match_the_padded_recording(reference, monkeypatch):
    """Our exact bias plus upstream's unmasked zero keys (80 beside 48 real keys in chunk 0, 32 beside 96 later)
    reproduces every recorded *padded* biased call (``flow_pred``): the padding is the only difference between
    upstream's biased path and ours."""
    meta, inputs, outputs, model = reference
    prompt = inputs["prompt_embeds"]
    padding = UpstreamPadding(model, monkeypatch)
    worst, calls = 0.0, 0
    try:
        for call in meta["variants"]["biased"]["calls"]:
            if call["recompute"] or call["chunk"] == 0 and call["name"].endswith("step0"):
                model.clear_caches()
            padding.active, before = not call["recompute"], len(padding.zero_keys)
            x = layout(outputs[f"{call['name']}.hidden_states"])
            out = model(
                x, torch.tensor([call["timestep"]]), prompt, start_frame=call["replay_start_frame"],
                store_kv=call["replay_store_kv"], kv_cache_attention_bias=call["kv_cache_attention_bias"],
                return_dict=False,
            )[0]  # fmt: skip
            worst = max(worst, (layout(out) - outputs[f"{call['name']}.flow_pred"]).abs().max().item())
            if padding.active:
                calls += 1
                added = padding.zero_keys[before:]
                assert added == [call["zero_keys_in_softmax"]] * len(model.blocks)
    finally:
        padding.remove_hooks()
        model.clear_caches()
    assert calls == 16 and worst <= 1e-5, worst


def test_the_padded_free_run_reaches_upstreams_biased_final_latents(reference, monkeypatch):
    """The whole biased run as upstream samples it (its draws and re-encoded anchors) with the padding added to the
    denoising forwards: the final latents are upstream's ``biased`` ones, far from the exact bias's."""
    _, _, outputs, model = reference
    padding = UpstreamPadding(model, monkeypatch)

    def forward(*args, **kwargs):
        padding.active = not kwargs.get("store_kv", False)  # the recompute pass is the only store
        return type(model).forward(model, *args, **kwargs)

    model.forward = forward  # run_policy wraps it, then removes both
    try:
        _, final, _ = run_policy(reference, "biased", "biased", 0.3)
    finally:
        padding.active = False
        padding.remove_hooks()
    error = (layout(final) - outputs["biased.final_latents"]).abs().max().item()
    assert error <= 1e-5, error
    assert (layout(final) - outputs["biased_nopad.final_latents"]).abs().max().item() > 0.1
