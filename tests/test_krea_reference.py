"""The Krea real-time reference (``tests/data/krea_tiny``, see its README) is loadable, self-consistent, and its
unbiased KV-recompute calls replay through our cache protocol.

The data are every transformer call daydreamlive/scope's Krea pipeline made with a tiny random Wan (4 chunks of 3
latent frames, context 3 frames, denoising steps [1000, 750, 500, 250]) for three variants:

* ``unbiased``: ``kv_cache_attention_bias=1.0``;
* ``biased``: ``kv_cache_attention_bias=0.3`` as upstream runs it (q/k/v zero-padded to a multiple of 128 without a
  mask); every biased call also has ``flow_pred_nopad``: the same call, same cache, with that padding removed;
* ``biased_nopad``: a free run with the padding removed (final latents only).

A recompute pass is a cleared cache and a ``store_kv`` forward over the context frames at ``start_frame=0`` (clean,
``t=0``); the chunk then denoises at ``start_frame=context_frames``. The free runs at the end go through the real
pipeline path (``pipe(..., kv_cache_policy="recompute", context_frames=3)``, its own streamed decode and re-encoded
anchors) and reach the recorded final latents: ``unbiased`` and, with the exact bias, ``biased_nopad``. The biased
calls are only checked for consistency here; ``test_krea_recompute.py`` replays them against our implementation.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import recorded_forwards
from safetensors.torch import load_file

from fastgen_diffusers import WanCausalTransformer3DModel

REFERENCE = Path(__file__).resolve().parent / "data" / "krea_tiny"
CHUNKS, CHUNK_FRAMES, CONTEXT_FRAMES, STEPS = 4, 3, 3, (1000.0, 750.0, 500.0, 250.0)
LATENT = (16, 8, 8)


@pytest.fixture(scope="module")
def reference():
    meta = json.loads((REFERENCE / "meta.json").read_text())
    inputs = load_file(REFERENCE / "inputs.safetensors")
    outputs = load_file(REFERENCE / "outputs.safetensors")
    model = WanCausalTransformer3DModel.from_pretrained(REFERENCE / "transformer", chunk_size=CHUNK_FRAMES).eval()
    return meta, inputs, outputs, model


def to_model_layout(x: torch.Tensor) -> torch.Tensor:
    """``[B, F, C, H, W]`` (the reference pipeline's layout) to ``[B, C, F, H, W]``."""
    return x.permute(0, 2, 1, 3, 4)


def grid_sigma(t: float) -> float:
    """Upstream's sigma for a model timestep: the nearest entry of the shift-5, 1000-step training grid."""
    sigmas = torch.linspace(1.0, 0.0, 1001, dtype=torch.float32)[:-1]
    sigmas = 5.0 * sigmas / (1 + 4.0 * sigmas)
    return float(sigmas[torch.argmin((sigmas * 1000 - t).abs())])


@pytest.mark.parametrize("variant", ["unbiased", "biased"])
def test_calls_are_complete_and_consistent(reference, variant):
    meta, inputs, outputs, _ = reference
    calls = meta["variants"][variant]["calls"]
    frame_tokens = meta["frame_seq_length"]
    # chunk 0: 4 denoise calls; every later chunk: one recompute pass then 4 denoise calls.
    assert len(calls) == len(STEPS) + (CHUNKS - 1) * (1 + len(STEPS))
    bias = 1.0 if variant == "unbiased" else 0.3
    for call in calls:
        x, out = outputs[f"{call['name']}.hidden_states"], outputs[f"{call['name']}.flow_pred"]
        assert x.shape == out.shape == (1, call["num_frames"], *LATENT)
        assert torch.isfinite(out).all()
        positions = call["rope"]["positions"]
        if call["recompute"]:
            assert call["chunk"] >= 1 and call["timestep"] == [0.0] * CONTEXT_FRAMES
            assert positions == [0, 1, 2] and call["cache_tokens_after"] == CONTEXT_FRAMES * frame_tokens
            assert call["kv_cache_attention_bias"] == 1.0  # the cache pass is never biased
            # context = the first latent (chunk 1) or the re-encoded anchor, then the last 2 latents produced
            final, c = outputs[f"{variant}.final_latents"], call["chunk"]
            assert torch.equal(x[:, 1:], final[:, 3 * c - 2 : 3 * c])
            assert torch.equal(x[:, :1], final[:, :1] if c == 1 else outputs[f"{variant}.chunk{c}.anchor.latent"])
        else:
            start = 0 if call["chunk"] == 0 else CONTEXT_FRAMES
            assert positions == list(range(start, start + CHUNK_FRAMES))
            assert max(positions) < CONTEXT_FRAMES + CHUNK_FRAMES  # RoPE stays bounded however long the video
            assert call["timestep"][0] in STEPS and len(set(call["timestep"])) == 1
            assert call["kv_cache_attention_bias"] == bias
            assert call["attended_tokens"] == (start + CHUNK_FRAMES) * frame_tokens
            if bias != 1.0:
                padded = -(-call["attended_tokens"] // 128) * 128
                assert call["zero_keys_in_softmax"] == padded - call["attended_tokens"]
                nopad = outputs[f"{call['name']}.flow_pred_nopad"]
                assert nopad.shape == out.shape
                assert (out - nopad).abs().max().item() == pytest.approx(call["nopad_max_abs_diff"])
    # the re-noise draws connect consecutive calls: x_{s+1} = (1 - sigma) * x0_s + sigma * eps_s, x0 = x - sigma_s * v
    for note in meta["variants"][variant]["renoise"]:
        prefix = f"{variant}.chunk{note['chunk']}.step{note['step']}"
        x, v = outputs[f"{prefix}.hidden_states"].double(), outputs[f"{prefix}.flow_pred"].double()
        x0 = (x - grid_sigma(STEPS[note["step"]]) * v).float()
        eps, sigma = inputs[f"{prefix}.renoise_noise"], grid_sigma(note["to_timestep"])
        assert sigma == pytest.approx(note["sigma"], abs=1e-7)
        expected = (1 - sigma) * x0 + sigma * eps
        following = outputs[f"{variant}.chunk{note['chunk']}.step{note['step'] + 1}.hidden_states"]
        torch.testing.assert_close(following, expected, rtol=0, atol=1e-5)


def test_recorded_facts(reference):
    meta, _, outputs, _ = reference
    facts = meta["facts"]
    assert facts["timesteps_to_model"] == [1000, 750, 500, 250]
    assert facts["renoise_sigmas"]["500"] == pytest.approx(0.5006, abs=1e-4)
    assert facts["renoise_sigmas"]["250"] == pytest.approx(0.2516, abs=1e-4)
    assert facts["noise_seed_rule_verified"] and facts["warmup_effect_on_final_latents"] == 0.0
    # context: the first latent frame while it is in reach, then a re-encoded decoded frame, plus the last 2 latents
    assert facts["context_sources"] == {
        "1": ["latent 0", "latent 1", "latent 2"],
        "2": ["re-encoded anchor", "latent 4", "latent 5"],
        "3": ["re-encoded anchor", "latent 7", "latent 8"],
    }
    # chunk 0 has no cached past frame to bias: there the biased run differs from the unbiased one by the padding only
    padding = facts["padding"]
    assert padding["chunk0_latents_biased_nopad_vs_unbiased_max_abs_diff"] < 1e-5
    assert padding["chunk0_latents_biased_vs_unbiased_max_abs_diff"] > 1e-2
    for variant in ("unbiased", "biased", "biased_nopad"):
        final = outputs[f"{variant}.final_latents"]
        assert final.shape == (1, CHUNKS * CHUNK_FRAMES, *LATENT) and torch.isfinite(final).all()


def test_anchor_reencode_uses_the_saved_vae(reference):
    """The re-encoded anchors are the saved diffusers VAE's encoding (mean, normalised) of the recorded pixel frame."""
    from diffusers import AutoencoderKLWan

    meta, inputs, outputs, _ = reference
    vae = AutoencoderKLWan.from_pretrained(REFERENCE / "vae").eval()
    mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
    anchors = meta["variants"]["unbiased"]["anchors"]
    assert [a["chunk"] for a in anchors] == [2, 3]
    for anchor in anchors:
        prefix = f"unbiased.chunk{anchor['chunk']}.anchor"
        with torch.no_grad():
            latent = (vae.encode(inputs[f"{prefix}.pixel"]).latent_dist.mean - mean) / std
        torch.testing.assert_close(to_model_layout(latent), outputs[f"{prefix}.latent"], rtol=0, atol=1e-5)
        # the anchor pixel frame is decoded frame 12 * (chunk - 1): the first of the last 9 decoded frames
        assert anchor["decoded_frame_index"] == 12 * (anchor["chunk"] - 1)
        # and that latent is the first frame of the chunk's recompute context
        context = outputs[f"unbiased.chunk{anchor['chunk']}.recompute.hidden_states"]
        assert torch.equal(context[:, :1], outputs[f"{prefix}.latent"])


@torch.no_grad()
def test_anchor_pixels_are_frames_of_the_decoded_video(reference):
    """Decoding all final latents at once with the saved VAE gives the recorded anchor pixel frames (upstream decoded
    chunk by chunk with a streaming cache; the difference is float32 rounding of the different call shapes)."""
    from diffusers import AutoencoderKLWan

    meta, inputs, outputs, _ = reference
    vae = AutoencoderKLWan.from_pretrained(REFERENCE / "vae").eval()
    mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
    for variant in ("unbiased", "biased"):
        video = vae.decode(to_model_layout(outputs[f"{variant}.final_latents"]) * std + mean).sample
        assert video.shape[2] == 1 + 4 * (CHUNKS * CHUNK_FRAMES - 1)
        for anchor in meta["variants"][variant]["anchors"]:
            frame = anchor["decoded_frame_index"]
            pixel = inputs[f"{variant}.chunk{anchor['chunk']}.anchor.pixel"]
            torch.testing.assert_close(video[:, :, frame : frame + 1], pixel, rtol=0, atol=1e-4)


@torch.no_grad()
def test_unbiased_recompute_calls_replay_through_our_cache(reference):
    """Every unbiased call: a recompute pass = cleared cache + store_kv over the context at start_frame 0."""
    meta, inputs, outputs, model = reference
    prompt = inputs["prompt_embeds"]
    worst = {"recompute": 0.0, "denoise": 0.0}
    for call in meta["variants"]["unbiased"]["calls"]:
        if call["recompute"] or call["chunk"] == 0 and call["name"].endswith("step0"):
            model.clear_caches()
        x = outputs[f"{call['name']}.hidden_states"]
        timestep = torch.tensor([call["timestep"]])
        out = model(
            to_model_layout(x),
            timestep,
            prompt,
            start_frame=call["replay_start_frame"],
            store_kv=call["replay_store_kv"],
            return_dict=False,
        )[0]
        error = (to_model_layout(out) - outputs[f"{call['name']}.flow_pred"]).abs().max().item()
        worst[call["kind"]] = max(worst[call["kind"]], error)
        if call["recompute"]:
            assert model.kv_cache_bytes() > 0
    assert max(worst.values()) <= 1e-5, worst


@torch.no_grad()
def test_unbiased_sampler_replay_reaches_the_final_latents(reference):
    """Recorded noise, re-noise draws and anchors through our transformer give the recorded final latents."""
    meta, inputs, outputs, model = reference
    prompt = inputs["prompt_embeds"]
    latents = []
    for chunk in range(CHUNKS):
        model.clear_caches()
        start = 0
        if chunk > 0:
            anchor = outputs[f"unbiased.chunk{chunk}.anchor.latent"] if chunk >= 2 else latents[0][:, :1]
            previous = torch.cat(latents, 1)[:, -(CONTEXT_FRAMES - 1) :]
            context = torch.cat([anchor, previous], 1)
            zeros = torch.zeros(1, CONTEXT_FRAMES)
            model(to_model_layout(context), zeros, prompt, start_frame=0, store_kv=True, return_dict=False)
            start = CONTEXT_FRAMES
        x = outputs[f"unbiased.chunk{chunk}.step0.hidden_states"]  # the chunk's initial noise
        for step, t in enumerate(STEPS):
            timestep = torch.full((1, CHUNK_FRAMES), t)
            v = model(to_model_layout(x), timestep, prompt, start_frame=start, return_dict=False)[0]
            x0 = (x.double() - grid_sigma(t) * to_model_layout(v).double()).float()
            if step + 1 < len(STEPS):
                sigma = grid_sigma(STEPS[step + 1])
                x = (1 - sigma) * x0 + sigma * inputs[f"unbiased.chunk{chunk}.step{step}.renoise_noise"]
        latents.append(x0)
    final = torch.cat(latents, 1)
    error = (final - outputs["unbiased.final_latents"]).abs().max().item()
    assert error <= 1e-5, error


# ------------------------------------------------------------------------------- the free runs through the pipeline
class RecordedKreaScheduler:
    """Upstream's sampler as the pipeline's scheduler (the one test hook of these runs): the timesteps reach the
    model as given, ``x0 = x - sigma * v`` with the grid sigma in float64, and the re-noise eps of chunk ``c`` are the
    recorded draws of ``torch.Generator().manual_seed(42 + 3c)`` (drawn in upstream's ``[B, F, C, H, W]`` layout, so
    a generator passed to the pipeline could not reproduce them). Chunks are counted by ``set_timesteps`` calls."""

    def __init__(self, scheduler, inputs, variant: str = "unbiased"):
        self.config, self.shift, self.order = scheduler.config, scheduler.shift, 1
        self.inputs, self.variant, self.chunk = inputs, variant, -1

    def set_timesteps(self, timesteps=None, device=None, **_):
        self.chunk, self.index = self.chunk + 1, 0
        self.timesteps = torch.tensor(timesteps, dtype=torch.float32)
        self.sigmas = torch.tensor([grid_sigma(float(t)) for t in timesteps] + [0.0])

    def set_begin_index(self, index):
        self.index = index

    def step(self, flow, t, x, generator=None, return_dict=False):
        x0 = (x.double() - grid_sigma(float(t)) * flow.double()).float()
        if self.index + 1 < len(self.timesteps):
            sigma = grid_sigma(float(self.timesteps[self.index + 1]))
            eps = self.inputs[f"{self.variant}.chunk{self.chunk}.step{self.index}.renoise_noise"]
            x0 = (1 - sigma) * x0 + sigma * to_model_layout(eps)
        self.index += 1
        return (x0,)


@pytest.fixture(scope="module")
def krea_pipe(reference):
    """A `WanCausalPipeline` of the reference's tiny transformer and VAE (no text encoder: the recorded embeddings)."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler

    from fastgen_diffusers import WanCausalPipeline

    transformer = WanCausalTransformer3DModel.from_pretrained(REFERENCE / "transformer", chunk_size=CHUNK_FRAMES)
    vae = AutoencoderKLWan.from_pretrained(REFERENCE / "vae").eval()
    scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0, stochastic_sampling=True)
    pipe = WanCausalPipeline(None, None, vae, scheduler, transformer.eval())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def free_run(reference, pipe, bias: float, output_type: str = "latent", **kwargs):
    """The whole recorded rollout through ``pipe(...)``: recompute with context 3, the recorded step-0 noise as
    ``latents``, upstream's sampler. Returns ``(frames, calls)``, calls = ``(start_frame, store_kv, hidden_states,
    flow)`` of every transformer forward."""
    _, inputs, outputs, _ = reference
    noise = torch.cat([outputs[f"unbiased.chunk{c}.step0.hidden_states"] for c in range(CHUNKS)], 1)
    pipe.scheduler, scheduler = RecordedKreaScheduler(pipe.scheduler, inputs), pipe.scheduler
    try:
        with recorded_forwards(pipe.transformer) as forwards:
            frames = pipe(
                prompt_embeds=inputs["prompt_embeds"], height=64, width=64,
                num_frames=1 + 4 * (CHUNKS * CHUNK_FRAMES - 1), timesteps=list(STEPS), latents=to_model_layout(noise),
                kv_cache_policy="recompute", context_frames=CONTEXT_FRAMES, kv_cache_attention_bias=bias,
                output_type=output_type, **kwargs,
            ).frames  # fmt: skip
    finally:
        pipe.scheduler = scheduler
    return frames, [(c.kwargs["start_frame"], c.kwargs["store_kv"], c.hidden_states, c.out) for c in forwards]


def test_unbiased_free_run_through_the_pipeline_matches_every_call_and_the_final_latents(reference, krea_pipe):
    """The real pipeline path: its own streamed decode and VAE re-encode of decoded frames 12 and 24 as anchors."""
    meta, _, outputs, _ = reference
    final, calls = free_run(reference, krea_pipe, 1.0)
    recorded = meta["variants"]["unbiased"]["calls"]
    assert len(calls) == len(recorded)
    # the recompute passes are store-only (no prediction): what they store is read by every later call
    assert [out is None for *_, out in calls] == [call["recompute"] for call in recorded]
    worst_in, worst_out = 0.0, 0.0
    for call, (start_frame, store_kv, x, out) in zip(recorded, calls):
        assert (start_frame, store_kv) == (call["replay_start_frame"], call["replay_store_kv"])
        worst_in = max(worst_in, (to_model_layout(x) - outputs[f"{call['name']}.hidden_states"]).abs().max().item())
        if out is None:
            continue
        worst_out = max(worst_out, (to_model_layout(out) - outputs[f"{call['name']}.flow_pred"]).abs().max().item())
    assert worst_in <= 1e-5 and worst_out <= 1e-5, (worst_in, worst_out)
    # the recompute passes of chunks 2 and 3 start with the re-encoded anchors
    for anchor in meta["variants"]["unbiased"]["anchors"]:
        index = next(i for i, c in enumerate(recorded) if c["name"] == f"unbiased.chunk{anchor['chunk']}.recompute")
        got = to_model_layout(calls[index][2][:, :, :1])
        assert (got - outputs[f"unbiased.chunk{anchor['chunk']}.anchor.latent"]).abs().max().item() <= 1e-5
    error = (to_model_layout(final) - outputs["unbiased.final_latents"]).abs().max().item()
    assert error <= 1e-5, error


def test_biased_free_run_through_the_pipeline_matches_biased_nopad(reference, krea_pipe):
    """The exact bias (0.3) reaches upstream's run without its padding; upstream's padded run is the artefact away."""
    _, _, outputs, _ = reference
    final = to_model_layout(free_run(reference, krea_pipe, 0.3)[0])
    error = (final - outputs["biased_nopad.final_latents"]).abs().max().item()
    assert error <= 1e-5, error
    artefact = (final - outputs["biased.final_latents"]).abs().max().item()
    assert artefact > 1e-2  # the 0.28 of the README: upstream's zero keys, which we do not reproduce


def test_free_run_frames_are_decoded_once_and_equal_a_decode_of_the_latents(reference, krea_pipe):
    """The frames `pipe(...)` returns under recompute are the policy's streamed decodes, equal to decoding the
    latents; no second decode of the video runs."""
    from fastgen_diffusers.pipelines.video_io import streaming_decode

    latents = free_run(reference, krea_pipe, 1.0)[0]
    decodes, decode = [], streaming_decode.StreamingWanDecoder.decode

    def counting(self, z):
        decodes.append(z.shape[2])
        return decode(self, z)

    streaming_decode.StreamingWanDecoder.decode = counting
    try:
        frames = free_run(reference, krea_pipe, 1.0, output_type="pt")[0]
    finally:
        streaming_decode.StreamingWanDecoder.decode = decode
    assert decodes == [CHUNK_FRAMES] * CHUNKS  # one decode per chunk, by the policy
    expected = krea_pipe.decode_latents(latents, output_type="pt")
    assert frames.shape == expected.shape and torch.equal(frames, expected)
