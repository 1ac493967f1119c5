"""The Reward Forcing and Rolling Forcing reference recordings load, are self-consistent, and replay where they can.

``tests/data/reward_forcing_tiny`` and ``tests/data/rolling_forcing_tiny`` (see their READMEs) hold a tiny random Wan
model and every transformer call that each project's own inference code made with it. Reward Forcing (window 9,
sink 3, chunks of 3) replays at parity with engines built with ``rope_positions="window"`` (keys stored before RoPE,
rotated by their slot in ``[sink | window | call]``, queries at 6..8 from chunk 2 on) and ``sink_update="ema"``
(the sink an EMA of the evicted frames), every call of both recorded variants; today's default cache (absolute
positions, fixed sink) only until the window slides. Rolling Forcing replays where absolute positions apply:

* Rolling Forcing (5 staggered steps, windows of 5 blocks): the denoising forwards of windows 0-6 (the anchor block is
  still at its absolute position) and every commit forward (the last 21 cached frames, absolute positions).

The other calls are what issue 15's window-relative RoPE, EMA sink and rolling rollout must reproduce; here their
recorded values are checked against the recorded sampler arithmetic and, for the EMA, against the sink state.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fastgen_diffusers import WanCausalTransformer3DModel
from fastgen_diffusers.kv_cache import make_engines

DATA = Path(__file__).resolve().parent / "data"
REWARD = DATA / "reward_forcing_tiny"
ROLLING = DATA / "rolling_forcing_tiny"
FRAME_SEQLEN = 16  # 8x8 latents, patch (1, 2, 2)
BLOCK = 3  # latent frames per chunk / block
PARITY = 1e-5


def load(directory: Path):
    meta = json.loads((directory / "meta.json").read_text())
    return meta, load_file(directory / "inputs.safetensors"), load_file(directory / "outputs.safetensors")


@pytest.fixture(scope="module")
def reward():
    return load(REWARD)


@pytest.fixture(scope="module")
def rolling():
    return load(ROLLING)


def model_layout(x: torch.Tensor) -> torch.Tensor:
    """``[B, F, C, H, W]`` (the upstream pipelines' layout) to ``[B, C, F, H, W]``."""
    return x.permute(0, 2, 1, 3, 4)


def load_model(directory: Path, chunk_size: int, window: int | None = None, sink: int = 0, kind: str = "static"):
    model = WanCausalTransformer3DModel.from_pretrained(directory / "transformer", chunk_size=chunk_size).eval()
    model.set_kv_cache_engines(make_engines(model, kind, window_frames=window, sink_frames=sink, max_frames=64))
    return model


def flow_grid(shift: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(timesteps, sigmas)`` of the upstream ``FlowMatchScheduler(shift, sigma_min=0, extra_one_step=True)`` after
    ``set_timesteps(1000, training=True)`` (float32, as upstream)."""
    sigmas = torch.linspace(1.0, 0.0, 1001)[:-1]
    sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    return sigmas * 1000, sigmas


def grid_sigma(timesteps: torch.Tensor, grid) -> torch.Tensor:
    """The sigma of the grid timestep nearest to each of ``timesteps`` (upstream's argmin lookup)."""
    grid_t, grid_s = grid
    return grid_s[torch.argmin((grid_t[None] - timesteps.float().flatten()[:, None]).abs(), dim=1)]


def to_x0(x: torch.Tensor, flow: torch.Tensor, timesteps: list[float], grid) -> torch.Tensor:
    """``x0 = x_t - sigma * flow`` per frame in float64, returned in float32 (``_convert_flow_pred_to_x0``)."""
    sigma = grid_sigma(torch.tensor(timesteps), grid).double().view(1, -1, 1, 1, 1)
    return (x.double() - sigma * flow.double()).float()


def add_noise(x0: torch.Tensor, eps: torch.Tensor, timestep: float, grid) -> torch.Tensor:
    """``(1 - sigma) * x0 + sigma * eps`` in float32 (``FlowMatchScheduler.add_noise``)."""
    sigma = grid_sigma(torch.tensor([timestep]), grid)
    return (1 - sigma) * x0 + sigma * eps


def assert_close(actual, expected, tol, what):
    diff = (actual - expected).abs().max().item()
    assert diff <= tol, f"{what}: max abs diff {diff:.3e} > {tol:.0e}"
    return diff


# ---------------------------------------------------------------- both recordings


@pytest.mark.parametrize("directory", [REWARD, ROLLING], ids=["reward", "rolling"])
def test_weights_load_into_the_causal_model(directory):
    meta = json.loads((directory / "meta.json").read_text())
    weights = load_file(directory / "transformer" / "diffusion_pytorch_model.safetensors")
    model = WanCausalTransformer3DModel.from_pretrained(directory / "transformer", chunk_size=BLOCK)
    state = model.state_dict()
    assert set(weights) == set(state)
    for name, tensor in weights.items():
        assert torch.equal(state[name], tensor), name
    assert model.config.num_layers == meta["tiny_config"]["num_layers"] == 2
    assert model.config.num_attention_heads * model.config.attention_head_dim == meta["tiny_config"]["dim"]
    # upstream init zeroes the output head; the recording's is random so that a wrong mapping shows
    assert model.proj_out.weight.abs().min() > 0


# ---------------------------------------------------------------- Reward Forcing


def reward_call_input(variant, call, inputs, outputs):
    """A recorded call's input: step 0 reads the noise, the context pass the chunk's final latents (not duplicated)."""
    chunk, kind, start = call["chunk"], call["kind"], call["start_frame"]
    if kind == "step0":
        return inputs[f"{variant}.noise"][:, start : start + BLOCK]
    if kind == "context":
        return outputs[f"{variant}.final_latents"][:, start : start + BLOCK]
    return outputs[f"{variant}.chunk{chunk}.{kind}.noisy_input"]


def test_reward_forcing_calls_positions_and_sink_updates(reward):
    meta, inputs, outputs = reward
    steps = meta["denoising_step_list_used"]
    assert steps == pytest.approx([1000.0, 937.5, 833.3333, 625.0], abs=1e-3)  # warp of [1000, 750, 500, 250], shift 5
    assert meta["config"]["model_kwargs"] == {"timestep_shift": 5.0, "local_attn_size": 9, "sink_size": 3}
    window, sink = 9, 3
    expected_keys = {"prompt_embeds"}
    for variant, info in meta["variants"].items():
        calls, first = info["calls"], info["first_stored_chunk"]
        assert len(calls) == info["num_chunks"] * (len(steps) + 1)
        assert inputs[f"{variant}.noise"].shape == (1, 3 * info["num_chunks"], 16, 8, 8)
        assert outputs[f"{variant}.final_latents"].shape == (1, 3 * info["num_chunks"], 16, 8, 8)
        expected_keys |= {f"{variant}.noise", f"{variant}.final_latents"}
        for call in calls:
            chunk, start = call["chunk"], call["start_frame"]
            assert start == BLOCK * chunk and call["num_frames"] == BLOCK
            step = len(steps) if call["kind"] == "context" else int(call["kind"][4:])
            assert call["timestep"] == ([0.0] if step == len(steps) else [steps[step]]) * BLOCK
            # queries at their slot in [sink | window]: 0, 3, then 6 for ever; keys roped from slot 0
            assert call["query_rope_start_frame"] == min(start, window - BLOCK)
            assert call["key_rope_start_frame"] == 0
            assert call["key_frames"] == min(start + BLOCK, window) == call["attention_k_tokens"] // FRAME_SEQLEN
            # the EMA runs once per chunk, in the first denoising call of every chunk that evicts a frame
            assert call["ema_sink_update"] == (chunk >= window // BLOCK and step == 0)
            if call["ema_sink_update"]:
                assert call["ema_alpha"] == info["sink_decay"] and call["evicted_frames"] == sink
            if chunk >= first:
                expected_keys.add(f"{variant}.chunk{chunk}.{call['kind']}.flow_pred")
                if 0 < step < len(steps):
                    expected_keys.add(f"{variant}.chunk{chunk}.{call['kind']}.noisy_input")
                if step < len(steps) - 1:
                    expected_keys.add(f"{variant}.chunk{chunk}.step{step}.renoise_noise")
                assert reward_call_input(variant, call, inputs, outputs).shape == (1, BLOCK, 16, 8, 8)
    sinks = {k for k in outputs if ".layer0.sink_" in k}
    assert sinks == {f"ema09.chunk{c}.layer0.sink_{kv}" for c in range(2, 7) for kv in "kv"}
    assert set(inputs) | set(outputs) == expected_keys | sinks


def test_reward_forcing_sampler_is_self_consistent(reward):
    """Every recorded input follows from the previous call's output and the recorded re-noise draw."""
    meta, inputs, outputs = reward
    steps = meta["denoising_step_list_used"]
    grid = flow_grid(meta["scheduler"]["shift"])
    for variant, info in meta["variants"].items():
        for chunk in range(info["first_stored_chunk"], info["num_chunks"]):
            calls = [c for c in info["calls"] if c["chunk"] == chunk]
            x = reward_call_input(variant, calls[0], inputs, outputs)
            for step, call in enumerate(calls[:-1]):
                assert_close(reward_call_input(variant, call, inputs, outputs), x, 1e-6, f"{variant} {chunk} {step}")
                x0 = to_x0(x, outputs[f"{variant}.chunk{chunk}.step{step}.flow_pred"], call["timestep"], grid)
                if step + 1 < len(steps):
                    eps = inputs[f"{variant}.chunk{chunk}.step{step}.renoise_noise"]
                    x = add_noise(x0, eps, steps[step + 1], grid)
            final = outputs[f"{variant}.final_latents"][:, BLOCK * chunk : BLOCK * (chunk + 1)]
            assert_close(x0, final, 1e-6, f"{variant} chunk {chunk} final x0")


def reward_model(kind: str, decay: float = 0.999, **engine_options):
    """The recording's model with Reward Forcing's cache: window 9, sink 3, window-relative RoPE, EMA sink."""
    model = WanCausalTransformer3DModel.from_pretrained(REWARD / "transformer", chunk_size=BLOCK).eval()
    options = {"rope_positions": "window", "sink_update": "ema", "sink_decay": decay, **engine_options}
    model.set_kv_cache_engines(make_engines(model, kind, window_frames=9, sink_frames=3, max_frames=64, **options))
    return model


def reward_calls(meta, variant):
    """``(variant the tensors come from, call)`` of every call of ``variant``: ``ema09`` takes chunks 0-2 from
    ``main`` (bit-identical when recorded, stored once)."""
    info = meta["variants"][variant]
    first = info["first_stored_chunk"]
    early = [("main", c) for c in meta["variants"]["main"]["calls"] if c["chunk"] < first]
    return early + [(variant, c) for c in info["calls"] if c["chunk"] >= first]


def layer0_sink(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 0's sink K/V ``(1, 48, 2, 32)`` as held (keys before RoPE): what a call at frame 3 sees of the cache."""
    return model.kv_cache_engines["main"].get_self_prefix(0, "pos", 3, BLOCK)


@pytest.mark.parametrize("kind", ["static", "vanilla"])
@pytest.mark.parametrize("variant", ["main", "ema09"])
@torch.no_grad()
def test_replaying_every_reward_forcing_call(reward, kind, variant):
    """Every recorded call (4 denoising steps and the context pass per chunk) at parity with window-relative RoPE
    and the EMA sink, store on the context pass only; ``ema09``'s layer-0 sink K/V equal the recorded ones."""
    meta, inputs, outputs = reward
    model = reward_model(kind, meta["variants"][variant]["sink_decay"])
    worst, worst_sink, replayed = 0.0, 0.0, 0
    for source, call in reward_calls(meta, variant):
        chunk = call["chunk"]
        out = model(
            model_layout(reward_call_input(source, call, inputs, outputs)),
            torch.tensor([call["timestep"]]),
            inputs["prompt_embeds"],
            start_frame=call["start_frame"],
            store_kv=call["kind"] == "context",
            return_dict=False,
        )[0]
        expected = model_layout(outputs[f"{source}.chunk{chunk}.{call['kind']}.flow_pred"])
        worst, replayed = (
            max(worst, assert_close(out, expected, PARITY, f"{variant} chunk {chunk} {call['kind']}")),
            replayed + 1,
        )
        sink_key = f"{variant}.chunk{chunk}.layer0.sink_k"
        if sink_key in outputs and chunk >= 2:  # recorded right after the chunk's update (chunk 2: before any)
            key, value = layer0_sink(model)
            worst_sink = max(worst_sink, assert_close(key, outputs[sink_key], PARITY, f"sink K after chunk {chunk}"))
            value_key = f"{variant}.chunk{chunk}.layer0.sink_v"
            worst_sink = max(
                worst_sink, assert_close(value, outputs[value_key], PARITY, f"sink V after chunk {chunk}")
            )
    assert replayed == meta["variants"][variant]["num_chunks"] * (len(meta["denoising_step_list_used"]) + 1)
    assert worst <= PARITY, f"max abs diff {worst:.3e} over {replayed} calls"


@torch.no_grad()
def test_free_running_reward_forcing_reaches_the_recorded_final_latents(reward):
    """The recorded sampler (x0 in float64, re-noise with the recorded draws) fed with our own predictions: the 30
    final latent frames of ``main`` match the recording (10 chunks, 7 EMA updates)."""
    meta, inputs, outputs = reward
    steps = meta["denoising_step_list_used"]
    grid = flow_grid(meta["scheduler"]["shift"])
    model = reward_model("static")
    finals = []
    for chunk in range(meta["variants"]["main"]["num_chunks"]):
        start = BLOCK * chunk
        x = inputs["main.noise"][:, start : start + BLOCK]
        for step, t in enumerate(steps):
            timestep = [t] * BLOCK
            flow = model(
                model_layout(x),
                torch.tensor([timestep]),
                inputs["prompt_embeds"],
                start_frame=start,
                return_dict=False,
            )[0]
            x0 = to_x0(x, model_layout(flow), timestep, grid)
            if step + 1 < len(steps):
                x = add_noise(x0, inputs[f"main.chunk{chunk}.step{step}.renoise_noise"], steps[step + 1], grid)
        model(model_layout(x0), torch.zeros(1, BLOCK), inputs["prompt_embeds"], start_frame=start, store_kv=True)
        finals.append(x0)
    assert_close(torch.cat(finals, dim=1), outputs["main.final_latents"], PARITY, "final latents")


@pytest.mark.parametrize("kind", ["static", "vanilla"])
def test_the_pipeline_reaches_the_recorded_final_latents(reward, monkeypatch, kind):
    """``WanCausalPipeline`` with the recorded noise, timesteps, prompt embeddings and Reward Forcing's cache options,
    its scheduler's re-noise draws replaced by the recorded ones (upstream draws them from the global RNG, in
    another layout): the 30 final latent frames of ``main`` match the recording."""
    import diffusers.schedulers.scheduling_flow_match_euler_discrete as scheduler_module

    from fastgen_diffusers import WanCausalPipeline
    from fastgen_diffusers.testing import tiny_scheduler, tiny_vae

    meta, inputs, outputs = reward
    num_chunks = meta["variants"]["main"]["num_chunks"]
    draws = []  # the scheduler draws once per step; the last step's draw is scaled by sigma 0
    for chunk in range(num_chunks):
        draws += [model_layout(inputs[f"main.chunk{chunk}.step{step}.renoise_noise"]) for step in range(3)] + [None]

    def recorded(shape, generator=None, device=None, dtype=None, layout=None):
        eps = draws.pop(0)
        return torch.zeros(shape, dtype=dtype) if eps is None else eps.to(dtype)

    monkeypatch.setattr(scheduler_module, "randn_tensor", recorded)
    transformer = WanCausalTransformer3DModel.from_pretrained(REWARD / "transformer", chunk_size=BLOCK).eval()
    pipe = WanCausalPipeline(None, None, tiny_vae(), tiny_scheduler(), transformer)
    pipe.set_progress_bar_config(disable=True)
    latents = pipe(
        prompt_embeds=inputs["prompt_embeds"],
        latents=model_layout(inputs["main.noise"]),
        num_frames=4 * (BLOCK * num_chunks - 1) + 1,
        height=64,
        width=64,
        timesteps=meta["denoising_step_list_used"],
        attention_window=9,
        sink_frames=3,
        rope_positions="window",
        sink_update="ema",
        sink_decay=meta["variants"]["main"]["sink_decay"],
        kv_cache_engine=kind,
        output_type="latent",
    ).frames
    assert not draws
    assert_close(latents, model_layout(outputs["main.final_latents"]), PARITY, "pipeline final latents")


@pytest.mark.parametrize("kind", ["static", "vanilla"])
@torch.no_grad()
def test_absolute_positions_and_a_fixed_sink_replay_only_until_the_window_slides(reward, kind):
    """Today's default cache (absolute RoPE, fixed sink) matches chunks 0-2 and not chunk 3: the recording tells
    the two apart."""
    meta, inputs, outputs = reward
    model = load_model(REWARD, chunk_size=BLOCK, window=9, sink=3, kind=kind)
    worst, replayed = 0.0, 0
    for call in meta["variants"]["main"]["calls"]:
        out = model(
            model_layout(reward_call_input("main", call, inputs, outputs)),
            torch.tensor([call["timestep"]]),
            inputs["prompt_embeds"],
            start_frame=call["start_frame"],
            store_kv=call["kind"] == "context",
            return_dict=False,
        )[0]
        diff = (out - model_layout(outputs[f"main.chunk{call['chunk']}.{call['kind']}.flow_pred"])).abs().max().item()
        if call["chunk"] < 3:
            worst, replayed = max(worst, diff), replayed + 1
        else:
            assert diff > 1e-3, f"chunk {call['chunk']} {call['kind']} unexpectedly matches ({diff:.2e})"
            break
    assert replayed == 15 and worst <= PARITY, f"max abs diff {worst:.3e} over {replayed} calls"


@torch.no_grad()
def test_reward_forcing_sink_is_an_ema_of_evicted_frames(reward):
    """Layer 0: sink = K/V of chunk 0 (pre-RoPE), then ``decay * sink + (1 - decay) * evicted`` once per chunk.

    Layer 0's K/V depend on the call's own input only, so each evicted chunk's K/V are those of its context pass
    (the chunk's final latents at t=0), which our model computes without any cache.
    """
    meta, inputs, outputs = reward
    info = meta["variants"]["ema09"]
    decay = info["sink_decay"]
    model = load_model(REWARD, chunk_size=BLOCK)
    attn = model.blocks[0].attn1
    captured = {}

    def capture(module, args, kwargs):
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        key = module.norm_k(module.to_k(hidden)).unflatten(2, (module.heads, -1))
        captured["kv"] = (key, module.to_v(hidden).unflatten(2, (module.heads, -1)))

    handle = attn.register_forward_pre_hook(capture, with_kwargs=True)
    try:

        def context_kv(chunk):
            model.clear_caches()
            final = outputs["ema09.final_latents"][:, BLOCK * chunk : BLOCK * (chunk + 1)]
            model(model_layout(final), torch.zeros(1, BLOCK), inputs["prompt_embeds"], return_dict=False)
            return captured["kv"]

        key, value = context_kv(0)
        assert_close(key, outputs["ema09.chunk2.layer0.sink_k"], PARITY, "sink K before any eviction")
        assert_close(value, outputs["ema09.chunk2.layer0.sink_v"], PARITY, "sink V before any eviction")
        updates = [c["chunk"] for c in info["calls"] if c["ema_sink_update"]]
        assert updates == list(range(3, info["num_chunks"]))
        for chunk in updates:
            evicted_k, evicted_v = context_kv(chunk - 2)  # the oldest non-sink chunk of the window
            previous_k, previous_v = (outputs[f"ema09.chunk{chunk - 1}.layer0.sink_{kv}"] for kv in "kv")
            expected_k = decay * previous_k + (1 - decay) * evicted_k
            expected_v = decay * previous_v + (1 - decay) * evicted_v
            assert_close(outputs[f"ema09.chunk{chunk}.layer0.sink_k"], expected_k, PARITY, f"sink K, chunk {chunk}")
            assert_close(outputs[f"ema09.chunk{chunk}.layer0.sink_v"], expected_v, PARITY, f"sink V, chunk {chunk}")
            # the update is visible at this decay (it is not a no-op)
            assert (expected_k - previous_k).abs().max() > 1e-3
    finally:
        handle.remove()


# ---------------------------------------------------------------- Rolling Forcing


def test_rolling_forcing_schedule_and_positions(rolling):
    meta, inputs, outputs = rolling
    steps = meta["denoising_step_list_used"]
    assert steps == pytest.approx([1000.0, 952.381, 882.3529, 769.2308, 555.5556], abs=1e-3)  # warp, shift 5
    n, blocks = len(steps), meta["num_blocks"]
    staggered = list(reversed(steps))  # oldest block of a full window at the lowest noise level
    assert meta["window_num"] == len(meta["windows"]) == blocks + n - 1
    assert len(meta["calls"]) == 2 * meta["window_num"]
    renoise_keys = set()
    for w, window in enumerate(meta["windows"]):
        start, end = max(0, w - n + 1), min(blocks - 1, w)
        assert (window["start_block"], window["end_block"], window["committed_block"]) == (start, end, start)
        size = end - start + 1
        expected = staggered[-size:] if start == 0 else staggered[:size]
        assert window["block_timesteps"] == expected
        denoise, commit = meta["calls"][2 * w], meta["calls"][2 * w + 1]
        assert (denoise["kind"], commit["kind"]) == ("denoise", "commit")
        assert not denoise["updating_cache"] and commit["updating_cache"]
        first = BLOCK * start
        assert denoise["start_frame"] == commit["start_frame"] == first
        assert denoise["timestep"] == [t for t in expected for _ in range(BLOCK)]
        assert commit["timestep"] == [0.0] * BLOCK and commit["num_frames"] == BLOCK
        assert outputs[f"window{w}.noisy_input"].shape == (1, BLOCK * size, 16, 8, 8)
        assert outputs[f"window{w}.flow_pred"].shape == (1, BLOCK * size, 16, 8, 8)
        # queries at their absolute frames; a denoising call sees the anchor (block 0, stored un-roped) rotated
        # to sit right before the working cache, whose size keeps queries + working + anchor <= 21 frames
        positions = denoise["key_positions"]
        assert positions["own"] == [first, first + BLOCK * size]
        assert denoise["query_rope_start_frame"] == first
        if start == 0:
            assert set(positions) == {"own"}
        else:
            working = min(first - BLOCK, 21 - BLOCK * size - BLOCK)
            assert positions["working"] == [first - working, first]
            assert positions["anchor"] == [first - working - BLOCK, first - working]
            assert denoise["key_frames"] == BLOCK + working + BLOCK * size
        # a commit sees the last 21 cached frames, itself included, at absolute positions (no anchor once they
        # no longer reach frame 0)
        assert commit["key_positions"]["cached_absolute"] == (
            [0, BLOCK] if start == 0 else [max(0, first + BLOCK - 21), first + BLOCK]
        )
        for entry in window["renoised_blocks"]:
            renoise_keys.add(f"window{w}.block{entry['block']}.renoise_noise")
        expected_renoised = [b for b in range(start, end + 1) if window["block_timesteps"][b - start] != steps[-1]]
        assert [e["block"] for e in window["renoised_blocks"]] == expected_renoised
    windows_keys = {
        f"window{w}.{k}"
        for w in range(meta["window_num"])
        for k in ("noisy_input", "flow_pred", "commit.input", "commit.flow_pred")
    }
    assert set(outputs) == windows_keys | {"final_latents"}
    assert set(inputs) == renoise_keys | {"noise", "prompt_embeds"}
    # the anchor leaves absolute position 0 from window 7 on, and the cache evicts (24 frames) from window 12 on
    relative = [c["window"] for c in meta["calls"] if c["key_positions"].get("anchor", [0])[0] > 0]
    assert relative == list(range(7, meta["window_num"]))
    evicting = [c["window"] for c in meta["calls"] if c["layer0_cache_after"][0] != c["layer0_cache_after"][1]]
    assert evicting and evicting[0] == 12


def test_rolling_forcing_sampler_is_self_consistent(rolling):
    """Window inputs = re-noised x0 of the previous window (+ fresh noise for the new block); commits take x0."""
    meta, inputs, outputs = rolling
    steps = meta["denoising_step_list_used"]
    grid = flow_grid(meta["scheduler"]["shift"])
    noisy_cache, latest_x0 = {}, {}
    for w, window in enumerate(meta["windows"]):
        start, end = window["start_block"], window["end_block"]
        x = outputs[f"window{w}.noisy_input"]
        for b in range(start, end + 1):
            block_input = x[:, BLOCK * (b - start) : BLOCK * (b - start + 1)]
            expected = noisy_cache.get(b, inputs["noise"][:, BLOCK * b : BLOCK * (b + 1)])
            assert_close(block_input, expected, 1e-6, f"window {w} block {b} input")
        x0 = to_x0(x, outputs[f"window{w}.flow_pred"], meta["calls"][2 * w]["timestep"], grid)
        assert_close(outputs[f"window{w}.commit.input"], x0[:, :BLOCK], 1e-6, f"window {w} commit input")
        for entry in window["renoised_blocks"]:
            b = entry["block"]
            eps = inputs[f"window{w}.block{b}.renoise_noise"]
            block_x0 = x0[:, BLOCK * (b - start) : BLOCK * (b - start + 1)]
            noisy_cache[b] = add_noise(block_x0, eps, entry["next_timestep"], grid)
        for b in range(start, end + 1):
            latest_x0[b] = x0[:, BLOCK * (b - start) : BLOCK * (b - start + 1)]
    final = torch.cat([latest_x0[b] for b in range(meta["num_blocks"])], dim=1)
    assert_close(final, outputs["final_latents"], 1e-6, "final latents")
    assert steps[-1] == min(steps)


@torch.no_grad()
def test_replaying_rolling_forcing_calls_with_absolute_positions(rolling):
    """Windows 0-6 replay at parity with the whole history visible (one chunk per window call); window 7 does not."""
    meta, inputs, outputs = rolling
    model = load_model(ROLLING, chunk_size=15)
    worst, replayed = 0.0, 0
    for call in meta["calls"]:
        w, commit = call["window"], call["kind"] == "commit"
        key = f"window{w}.commit" if commit else f"window{w}"
        x = outputs[f"{key}.input" if commit else f"{key}.noisy_input"]
        out = model(
            model_layout(x),
            torch.tensor([call["timestep"]]),
            inputs["prompt_embeds"],
            start_frame=call["start_frame"],
            store_kv=commit,
            return_dict=False,
        )[0]
        diff = (out - model_layout(outputs[f"{key}.flow_pred"])).abs().max().item()
        if w < 7:
            worst, replayed = max(worst, diff), replayed + 1
        else:
            assert not commit and diff > 1e-3, f"window {w} {call['kind']}: {diff:.2e}"
            break
    assert replayed == 14
    assert worst <= PARITY, f"max abs diff {worst:.3e} over {replayed} calls"


@pytest.mark.parametrize("kind", ["static", "vanilla"])
@torch.no_grad()
def test_replaying_every_rolling_forcing_commit(rolling, kind):
    """Commit forwards attend to the last 21 cached frames with absolute positions: a 21-frame window, no sink."""
    meta, inputs, outputs = rolling
    model = load_model(ROLLING, chunk_size=BLOCK, window=21, sink=0, kind=kind)
    worst, replayed = 0.0, 0
    for call in meta["calls"]:
        if call["kind"] != "commit":
            continue
        key = f"window{call['window']}.commit"
        out = model(
            model_layout(outputs[f"{key}.input"]),
            torch.zeros(1, BLOCK),
            inputs["prompt_embeds"],
            start_frame=call["start_frame"],
            store_kv=True,
            return_dict=False,
        )[0]
        worst = max(worst, (out - model_layout(outputs[f"{key}.flow_pred"])).abs().max().item())
        replayed += 1
    assert replayed == meta["window_num"] == 14
    assert worst <= PARITY, f"max abs diff {worst:.3e} over {replayed} commits"
