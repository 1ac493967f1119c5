"""The causal rollout at real scale: Wan2.1-1.3B shapes with random weights, bf16, 480x832, 81 frames.

Prepared for a session that is lent a GPU: one script, one run, the figures for a closing note.

* frames per second of the transformer rollout (7 chunks x (4 denoising steps + 1 cache pass); the text encoder and
  the VAE are not the causal part and are left out), time to the first chunk, time per chunk;
* peak memory against weights + the cache formula 2 x layers x batch x heads x tokens x head_dim x bytes;
* static vs vanilla engine;
* the CUDA-only path checked against the one the CPU tests cover: a multi-chunk call with the FlexAttention block
  mask vs the SDPA boolean mask;
* ``--policies`` (eager, before the compiled rows; the cache policies' costs at this scale, one line each, driven at
  the transformer level):

  - ``[window rope]`` a windowed rollout (window 9, sink 3, 12 chunks of 3, 4 steps + cache pass) with absolute
    positions vs Reward Forcing's window RoPE + EMA sink (keys stored before RoPE, rotated at every read), static and
    vanilla engines: median time per chunk once the window slides, frames/s and its ratio, self cache bytes vs the
    formula;
  - ``[kv8]`` int8 and float8_e4m3fn self K/V vs the compute-dtype cache on the 81-frame rollout of the first
    bullet (no window), both engines (an 8-bit static engine gathers and dequantizes instead of its in-place path):
    bytes held and allocated vs the formula (1 byte per element + float32 scales per frame and head), frames/s ratio,
    max and mean abs output diff;
  - ``[bias]`` Krea's ``kv_cache_attention_bias=0.3`` on a windowed denoising forward (static engine, window 9 sink 3,
    slid): SDPA additive float mask vs FlexAttention ``score_mod`` max abs diff, time per forward of each and of bias
    1 (no mask; the first forward, which compiles flex on CUDA, apart);
  - ``[recompute]`` Krea's recompute (``RecomputePolicy``, context 3, ``keep_first_frame``; unbiased and bias 0.3)
    vs the sequential rollout at the same context (window 6), 8 chunks: median time per chunk, frames/s ratio,
    forwards;
  - ``[rolling]`` Rolling Forcing's rolling window (``RollingPolicy``, engines window 24 with the anchor) vs chunk by
    chunk (``SequentialPolicy``), 7 chunks x 5 warped steps: forwards per chunk, latent frames the forwards carry,
    frames/s and their ratios.

  The policies run through their own ``run`` with a stand-in for the pipeline (scheduler and progress bar only: no
  text encoder, no VAE), as ``tests/test_rolling_forcing.py`` drives them.
* ``--weights float8|int8``: the transformer saved and loaded under diffusers' quantization
  (``from_pretrained(..., quantization_config=TorchAoConfig(...))``; float8 dynamic activation + weight per row needs
  CUDA compute capability >= 8.9, int8 weight-only runs anywhere): weight bytes; the rollout of the first bullet
  eager and, with ``--compile``, compiled (fullgraph), frames/s and ratio to the compute dtype's in the same run (and
  compiled vs compiled at the end); relative L2 error per chunk and on the final latents of a sampled 4-step rollout;
* ``--attention-backends a,b,...``: ``set_attention_backend(name)`` (diffusers' dispatcher, which the causal
  processors call for every unmasked attention): frames/s, ratio and max abs diff against the default path, each; a
  backend whose package is missing is one FAILED line.

Every section (and every part of ``--policies``) runs in its own ``try``: a failure prints one line and the script
goes on. Prints are flushed.

Usage: ``python benchmarks/bench_gpu_scale.py --compile --cuda-graphs --policies [--weights float8]
[--attention-backends native,_native_cudnn,...]`` on a GPU (a few minutes on an
H200: about 70 s without ``--policies``, most of it compiling; ``--policies`` adds an estimated 1.5-2 min);
``python benchmarks/bench_gpu_scale.py --tiny --device cpu [--policies]`` is a seconds-long smoke test of the script
itself.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import CHUNK, STEPS, section, synchronize

from fastgen_diffusers import WanCausalTransformer3DModel, expected_self_cache_bytes, make_engines
from fastgen_diffusers.chunking import ChunkPlan
from fastgen_diffusers.convert.formats import warp_timesteps
from fastgen_diffusers.kv_cache import expected_scale_bytes
from fastgen_diffusers.memory_plan import WAN_1_3B, plan_rollout_memory
from fastgen_diffusers.pipelines.rollout.conditioning import Conditioner
from fastgen_diffusers.pipelines.rollout.core import CausalRolloutMixin
from fastgen_diffusers.pipelines.rollout.policy import SequentialPolicy
from fastgen_diffusers.pipelines.rollout.policy_recompute import RecomputePolicy
from fastgen_diffusers.pipelines.rollout.policy_rolling import ANCHOR_POSITIONS, RollingPolicy
from fastgen_diffusers.pipelines.rollout.session import RolloutSession
from fastgen_diffusers.pipelines.rollout.sources import NoiseSource
from fastgen_diffusers.testing import PolicyHost

TINY = {**WAN_1_3B, "num_attention_heads": 2, "attention_head_dim": 32, "ffn_dim": 64, "num_layers": 2}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@torch.no_grad()
def rollout(model, latents, prompt, chunk: int, device, mark_steps: bool = False):
    """Seconds of each chunk of a cached rollout (every chunk pays its steps and its cache pass) and the last
    denoising output of every chunk, concatenated over frames.

    ``mark_steps``: tell CUDA graph trees where each forward begins (``mode="reduce-overhead"``).
    """
    model.clear_caches()
    batch = latents.shape[0]
    times, outputs = [], []
    for start in range(0, latents.shape[2], chunk):
        synchronize(device)
        begin = time.perf_counter()
        x = latents[:, :, start : start + chunk]
        for t in (*STEPS, 0.0):
            if mark_steps:
                torch.compiler.cudagraph_mark_step_begin()
            out = model(x, torch.full((batch,), t, device=device), prompt, start_frame=start, store_kv=t == 0.0)
            if t == STEPS[-1]:
                outputs.append(out.sample.clone())
        synchronize(device)
        times.append(time.perf_counter() - begin)
    return times, torch.cat(outputs, dim=2)


def graph_count() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


# ---------------------------------------------------------------------------------------------- cache policies
WINDOW, SINK = 9, 3  # Reward Forcing's cache (latent frames)
WINDOW_MODES = {
    "absolute": {},
    "window+ema": {"rope_positions": "window", "sink_update": "ema", "sink_decay": 0.999},
}
CONTEXT = 3  # Krea's context_frames
ROLLING_FORCING_STEPS = warp_timesteps([1000, 800, 600, 400, 200], 5.0)


class Scale:
    """What the policy parts share: the model, the text ``(1, 512, text_dim)``, the latent size ``(H / 8, W / 8)`` and
    tokens per frame of the run (a plain class: the smoke tests load this script without registering it, which a
    dataclass needs)."""

    def __init__(self, model, prompt, device, dtype, latent_size, tokens_per_frame, tiny) -> None:
        self.model, self.prompt, self.device, self.dtype = model, prompt, device, dtype
        self.latent_size, self.tokens_per_frame, self.tiny = latent_size, tokens_per_frame, tiny

    def noise(self, frames: int, seed: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``(1, 16, frames, H / 8, W / 8)`` Gaussian latents (the compute dtype unless ``dtype``)."""
        gen = torch.Generator().manual_seed(seed)
        latents = torch.randn(1, 16, frames, *self.latent_size, generator=gen)
        return latents.to(self.device, dtype or self.dtype)

    def self_formula(self, frames: int, dtype: torch.dtype) -> int:
        config = self.model.config
        heads, head_dim = config.num_attention_heads, config.attention_head_dim
        return expected_self_cache_bytes(config.num_layers, 1, heads, frames * self.tokens_per_frame, head_dim, dtype)

    def engines(self, kind: str, max_frames: int, **options) -> None:
        self.model.set_kv_cache_engines(make_engines(self.model, kind, max_frames=max_frames, **options))

    def held(self) -> tuple[int, int, int]:
        """Self-attention bytes held, allocated, and frames held (tag ``"pos"``) over the model's engines."""
        engines = self.model.kv_cache_engines.values()
        return (
            sum(e.self_cache_bytes() for e in engines),
            sum(e.allocated_self_cache_bytes() for e in engines),
            max(e.held_frames("pos") for e in engines),
        )


def video_frames(latent_frames: int) -> int:
    """Pixel frames of ``latent_frames`` latent frames (Wan's 4x temporal VAE: 4k + 1)."""
    return 4 * (latent_frames - 1) + 1


def report(label: str, text: str) -> None:
    print(f"[{label}] {text}", flush=True)


def window_rope_part(scale: Scale) -> None:
    """(1) Windowed rollout (window 9, sink 3) with absolute positions vs window RoPE + EMA sink, per engine: the
    median chunk time once the window slides, frames/s, self cache bytes."""
    chunks = 5 if scale.tiny else 12
    latents = scale.noise(CHUNK * chunks, seed=1)
    slid = WINDOW // CHUNK  # chunks from this index on evict (the window is full)
    for kind in ("static", "vanilla"):
        medians = {}
        for mode, options in WINDOW_MODES.items():
            scale.engines(kind, CHUNK * chunks, window_frames=WINDOW, sink_frames=SINK, **options)
            rollout(scale.model, latents[:, :, : 2 * CHUNK], scale.prompt, CHUNK, scale.device)  # warm-up
            times, _ = rollout(scale.model, latents, scale.prompt, CHUNK, scale.device)
            medians[mode] = statistics.median(times[slid:])
            held, allocated, frames = scale.held()
            formula = scale.self_formula(frames, scale.dtype)
            median, speed = medians[mode], medians["absolute"] / medians[mode]
            report(
                "window rope",
                f"{kind} {mode}: {median * 1e3:.1f} ms per chunk once the window slides (median of {chunks - slid} "
                f"chunks) = {4 * CHUNK / median:.1f} frames/s, x{speed:.3f} of absolute's; self cache held "
                f"{held / 2**20:.1f} MiB ({frames} frames) vs formula {formula / 2**20:.1f} MiB (ratio "
                f"{held / formula:.3f}), allocated {allocated / 2**20:.1f} MiB",
            )


def kv8_part(scale: Scale, latents: torch.Tensor, eager: dict) -> None:
    """(2) int8 / float8_e4m3fn self K/V against the compute-dtype cache on the full rollout (no window), per
    engine: bytes held and allocated vs the formula (1 byte + float32 scales), frames/s ratio, output diff."""
    frames = latents.shape[2]
    data_formula = scale.self_formula(frames, torch.int8)
    config = scale.model.config
    formula = data_formula + expected_scale_bytes(config.num_layers, 1, config.num_attention_heads, frames)
    for kind in ("static", "vanilla"):
        if kind not in eager:  # its eager row failed or did not run: measure the compute-dtype cache here
            scale.engines(kind, frames)
            rollout(scale.model, latents[:, :, : 2 * CHUNK], scale.prompt, CHUNK, scale.device)
            times, outputs = rollout(scale.model, latents, scale.prompt, CHUNK, scale.device)
            eager[kind] = (sum(times), outputs)
        base_total, base_outputs = eager[kind]
        for storage in (torch.int8, torch.float8_e4m3fn):
            scale.engines(kind, frames, kv_cache_dtype=storage)
            rollout(scale.model, latents[:, :, : 2 * CHUNK], scale.prompt, CHUNK, scale.device)  # warm-up
            times, outputs = rollout(scale.model, latents, scale.prompt, CHUNK, scale.device)
            total = sum(times)
            held, allocated, _ = scale.held()
            scales = sum(e.self_cache_scale_bytes() for e in scale.model.kv_cache_engines.values())
            error = (outputs.float() - base_outputs.float()).abs()
            name, compute = str(storage).removeprefix("torch."), str(scale.dtype).removeprefix("torch.")
            report(
                "kv8",
                f"{kind} {name}: cache held {held / 2**20:.1f} MiB (scales {scales / 2**10:.1f} KiB), allocated "
                f"{allocated / 2**20:.1f} MiB vs formula {formula / 2**20:.1f} MiB = 1 byte per element "
                f"{data_formula / 2**20:.1f} MiB + scales {(formula - data_formula) / 2**10:.1f} KiB (ratio held "
                f"{held / formula:.4f}, allocated {allocated / formula:.4f}; vs the {compute} cache "
                f"{held / scale.self_formula(frames, scale.dtype):.4f}); rollout {total:.2f} s = "
                f"{video_frames(frames) / total:.1f} frames/s, x{base_total / total:.3f} of the {kind} {compute} "
                f"cache's; output vs that cache: max abs diff {error.max().item():.3e}, mean "
                f"{error.mean().item():.3e} (|out| max {base_outputs.abs().max().item():.2f})",
            )


def bias_part(scale: Scale, repeats: int) -> None:
    """(3) Krea's attention bias 0.3 on a windowed denoising forward (static engine, window 9 with sink 3, slid):
    SDPA additive float mask vs FlexAttention score_mod (max abs diff, time per forward), and bias 1 (no mask)."""
    model, device = scale.model, scale.device
    filled = WINDOW // CHUNK + 1  # chunks stored: the window has slid
    latents = scale.noise(CHUNK * (filled + 1), seed=2)
    scale.engines("static", CHUNK * (filled + 1), window_frames=WINDOW, sink_frames=SINK)
    model.clear_caches()
    for index in range(filled):
        x = latents[:, :, CHUNK * index : CHUNK * (index + 1)]
        model(x, torch.zeros(1, device=device), scale.prompt, start_frame=CHUNK * index, store_kv=True)
    x, start = latents[:, :, CHUNK * filled :], CHUNK * filled
    timestep = torch.full((1,), STEPS[1], device=device)
    outputs, seconds = {}, {}
    rows = (("sdpa float mask", "sdpa", 0.3), ("flex score_mod", "flex", 0.3), ("no mask (bias 1)", "auto", 1.0))
    try:
        for label, backend, bias in rows:
            model.set_block_mask_backend(backend)
            times = []
            for _ in range(1 + repeats):  # the first forward builds the masks (and compiles flex on CUDA)
                synchronize(device)
                begin = time.perf_counter()
                out = model(x, timestep, scale.prompt, start_frame=start, kv_cache_attention_bias=bias)
                synchronize(device)
                times.append(time.perf_counter() - begin)
            outputs[label], seconds[label] = out.sample.float(), (times[0], statistics.median(times[1:]))
    finally:
        model.set_block_mask_backend("auto")
    diff = (outputs["flex score_mod"] - outputs["sdpa float mask"]).abs().max().item()
    moved = (outputs["sdpa float mask"] - outputs["no mask (bias 1)"]).abs().max().item()
    none = seconds["no mask (bias 1)"][1]
    report(
        "bias",
        f"0.3 on a windowed denoising forward (chunk at frame {start}, window {WINDOW} sink {SINK}): flex "
        f"score_mod vs sdpa float mask max abs diff {diff:.3e} (the bias moves the output by {moved:.3e}, |out| max "
        f"{outputs['no mask (bias 1)'].abs().max().item():.2f})",
    )
    for label, (first, median) in seconds.items():
        report(
            "bias",
            f"{label}: {median * 1e3:.1f} ms per forward (median of {repeats}; first {first * 1e3:.1f} ms), time "
            f"x{median / none:.3f} of no mask's",
        )


def chunk_plan(host: PolicyHost, chunks: int, steps: int, timesteps=None) -> ChunkPlan:
    """``chunks`` chunks of ``CHUNK`` frames on ``host``'s scheduler (``steps`` steps, or the given ``timesteps``)."""
    schedule = CausalRolloutMixin.rollout_schedule(host, steps, timesteps=timesteps)
    return ChunkPlan.from_bounds([(CHUNK * b, CHUNK * (b + 1)) for b in range(chunks)], schedule)


def policy_rollout(
    scale: Scale, policy, plan: ChunkPlan, noise: torch.Tensor
) -> tuple[list[float], dict[str, int], list[torch.Tensor]]:
    """Seconds between the chunks a policy yields (the first from the start), its forwards (denoising, cache, latent
    frames carried) and the latents of the chunks it yields, on a fresh cache."""
    model, device = scale.model, scale.device
    counts = {"denoise": 0, "store": 0, "frames": 0}
    forward = model.forward

    def counting(hidden_states, *args, **kwargs):
        counts["store" if kwargs.get("store_kv") else "denoise"] += 1
        counts["frames"] += hidden_states.shape[2]
        return forward(hidden_states, *args, **kwargs)

    session = RolloutSession(
        model, Conditioner(), prompt_embeds=scale.prompt, negative_prompt_embeds=None, guidance_scale=1.0,
        context_noise=0.0, schedule=plan.schedules[0], keep_history=False,
    )  # fmt: skip
    model.clear_caches()
    model.forward = counting
    times, chunks = [], []
    try:
        synchronize(device)
        last = time.perf_counter()
        for record in policy.run(PolicyHost(), session, plan, NoiseSource(noise)):
            synchronize(device)
            now = time.perf_counter()
            times.append(now - last)
            chunks.append(record.latents)
            last = now
    finally:
        del model.forward
    return times, counts, chunks


def recompute_part(scale: Scale) -> None:
    """(4) Krea's recompute (context 3: a cache pass over the context before each chunk, none after it) against the
    sequential rollout attending to as many frames (window 6 = context + chunk), static engine, 4 steps: median time
    per chunk from chunk 1 on."""
    chunks = 4 if scale.tiny else 8
    host = PolicyHost()
    plan = chunk_plan(host, chunks, len(STEPS))
    noise = scale.noise(CHUNK * chunks, seed=3, dtype=torch.float32)
    rows = {
        "windowed": (SequentialPolicy(), {"window_frames": CONTEXT + CHUNK}, CHUNK * chunks),
        "recompute": (RecomputePolicy(CONTEXT, keep_first_frame=True, output_frames=False), {}, CONTEXT + CHUNK),
        "recompute, bias 0.3": (
            RecomputePolicy(CONTEXT, keep_first_frame=True, kv_cache_attention_bias=0.3, output_frames=False),
            {},
            CONTEXT + CHUNK,
        ),
    }
    reference = None
    for name, (policy, options, max_frames) in rows.items():
        scale.engines("static", max_frames, **options)
        times, counts, _ = policy_rollout(scale, policy, plan, noise)
        median = statistics.median(times[1:])
        reference = reference or median
        held, _, frames = scale.held()
        report(
            "recompute",
            f"{name} (context {CONTEXT}, {chunks} chunks): {median * 1e3:.1f} ms per chunk (median from chunk 1) = "
            f"{4 * CHUNK / median:.1f} frames/s, x{reference / median:.3f} of windowed's; forwards "
            f"{counts['denoise']} denoising + {counts['store']} cache; cache held {held / 2**20:.1f} MiB ({frames} "
            "frames)",
        )


def rolling_part(scale: Scale) -> None:
    """(5) Rolling Forcing's rolling window (RollingPolicy: windows of up to 5 chunks at staggered levels + commits,
    engines window 24 with the 3-frame anchor, anchor positions) against chunk by chunk (SequentialPolicy, no
    window), both on Rolling Forcing's 5 warped steps, static engine: forwards per chunk, frames/s (second run)."""
    chunks = 5 if scale.tiny else 7
    host = PolicyHost()
    plan = chunk_plan(host, chunks, len(ROLLING_FORCING_STEPS), timesteps=list(ROLLING_FORCING_STEPS))
    noise = scale.noise(CHUNK * chunks, seed=4, dtype=torch.float32)
    frames = video_frames(CHUNK * chunks)
    rolling = RollingPolicy()
    window = rolling.engine_window(CHUNK)
    rows = {
        "sequential": (SequentialPolicy(), {}),
        "rolling": (
            rolling,
            {"window_frames": window.frames, "sink_frames": window.sink, "rope_positions": ANCHOR_POSITIONS},
        ),
    }
    measured = {}
    for name, (policy, options) in rows.items():
        scale.engines("static", CHUNK * chunks, **options)
        policy_rollout(scale, policy, plan, noise)  # warm-up (the rolling windows' shapes)
        times, counts, _ = policy_rollout(scale, policy, plan, noise)
        forwards, total = counts["denoise"] + counts["store"], sum(times)
        measured[name] = (forwards / chunks, total)
        report(
            "rolling",
            f"{name}: {chunks} chunks x {len(ROLLING_FORCING_STEPS)} steps, forwards {forwards} ({counts['denoise']} "
            f"denoising + {counts['store']} cache, carrying {counts['frames']} latent frames) = "
            f"{forwards / chunks:.2f} per chunk; rollout {total:.2f} s = {frames / total:.1f} frames/s, first chunk "
            f"out after {times[0]:.3f} s",
        )
    (seq_forwards, seq_total), (roll_forwards, roll_total) = measured["sequential"], measured["rolling"]
    report(
        "rolling",
        f"rolling vs sequential: forwards per chunk x{roll_forwards / seq_forwards:.2f}, frames/s "
        f"x{seq_total / roll_total:.2f}",
    )


# ------------------------------------------------------------------------------------ weights and attention
def relative_l2(value: torch.Tensor, reference: torch.Tensor) -> float:
    return ((value.float() - reference.float()).norm() / reference.float().norm()).item()


def sampled_chunks(scale: Scale, frames: int) -> list[torch.Tensor]:
    """The latents of every chunk of a sampled rollout (``SequentialPolicy``, 4 steps, static engine; noise seed 5, the
    re-noising between steps from the global RNG seeded 6) of ``frames`` latent frames on ``scale.model``."""
    host = PolicyHost()
    torch.manual_seed(6)
    noise = scale.noise(frames, seed=5, dtype=torch.float32)
    scale.engines("static", frames)
    return policy_rollout(scale, SequentialPolicy(), chunk_plan(host, frames // CHUNK, len(STEPS)), noise)[2]


def timed_rollout(model, latents, prompt, device, mark_steps: bool = False) -> tuple[float, torch.Tensor]:
    """Seconds and outputs of the second of two :func:`rollout` calls on a fresh static engine (the first warms up,
    and compiles a compiled model)."""
    model.set_kv_cache_engines(make_engines(model, "static", max_frames=latents.shape[2]))
    rollout(model, latents, prompt, CHUNK, device, mark_steps)
    times, outputs = rollout(model, latents, prompt, CHUNK, device, mark_steps)
    return sum(times), outputs


def weights_part(scale: Scale, weights: str, latents, eager: dict, compiled: dict, compile_too: bool) -> None:
    """(6) The transformer under diffusers' own quantization, against the compute-dtype model in the same process:
    saved, then loaded with ``from_pretrained(..., quantization_config=TorchAoConfig(config))`` (``float8``: dynamic
    activation + weight per row, CUDA compute capability >= 8.9; ``int8``: weight-only). Rows: weight bytes; the
    rollout of section 1 (static engine) eager, frames/s and ratio to the compute dtype's; with ``compile_too``, the
    quantized blocks compiled (fullgraph) too; and a sampled rollout (4 steps) of each model: relative L2 error of
    every chunk's latents and of the final latents."""
    import tempfile

    from _common import quantization_config, weight_bytes
    from diffusers import TorchAoConfig

    device, model, frames = scale.device, scale.model, latents.shape[2]
    config = quantization_config(weights, device)
    with tempfile.TemporaryDirectory() as folder:  # device_map: straight onto the GPU (a CPU run loads on the CPU)
        model.save_pretrained(folder)
        quantized = WanCausalTransformer3DModel.from_pretrained(
            folder, torch_dtype=scale.dtype, quantization_config=TorchAoConfig(config),
            device_map=str(device) if device.type == "cuda" else None,
        ).eval()  # fmt: skip
    label = f"weights {weights}"
    num_frames = video_frames(frames)
    held, base = weight_bytes(quantized), weight_bytes(model)
    planned = plan_rollout_memory(
        model.config, weight_dtype={"float8": "float8_e4m3fn", "int8": "int8"}[weights],
        compute_dtype=str(scale.dtype).removeprefix("torch."),
    ).weights  # fmt: skip
    eager_total = eager["static"][0]
    total, outputs = timed_rollout(quantized, latents, scale.prompt, device)
    diff = relative_l2(outputs, eager["static"][1])
    report(
        label,
        f"eager: rollout {total:.2f} s = {num_frames / total:.1f} frames/s (x{eager_total / total:.2f} the "
        f"{str(scale.dtype).removeprefix('torch.')} static rollout's, same run); weights {held / 2**30:.2f} GiB "
        f"(plan {planned / 2**30:.2f} GiB, ratio {held / planned:.4f}) vs {base / 2**30:.2f} GiB unquantized; "
        f"relative L2 of the outputs {diff:.2e}",
    )
    if compile_too:
        from torch import _dynamo

        _dynamo.reset()
        quantized.compile_repeated_blocks(fullgraph=True)
        total, _ = timed_rollout(quantized, latents, scale.prompt, device)
        compiled[label] = total
        report(
            label,
            f"compiled (fullgraph): rollout {total:.2f} s = {num_frames / total:.1f} frames/s "
            f"(x{eager_total / total:.2f} the eager compute-dtype rollout's)",
        )
    sampled = frames // CHUNK * CHUNK
    reference = sampled_chunks(scale, sampled)
    on_quantized = Scale(
        quantized, scale.prompt, device, scale.dtype, scale.latent_size, scale.tokens_per_frame, scale.tiny
    )
    chunks = sampled_chunks(on_quantized, sampled)
    errors = [relative_l2(q, r) for q, r in zip(chunks, reference)]
    final = relative_l2(torch.cat(chunks, 2), torch.cat(reference, 2))
    report(
        label,
        f"sampled rollout ({len(chunks)} chunks x {len(STEPS)} steps): relative L2 error per chunk "
        + ", ".join(f"{e:.2e}" for e in errors)
        + f"; final latents {final:.2e}",
    )
    del quantized


def backend_part(scale: Scale, backend: str, latents, eager: dict) -> None:
    """(7) ``model.set_attention_backend(backend)`` (diffusers' dispatcher, which the causal processors call for every
    unmasked attention): the rollout of section 1 (static engine), frames/s, ratio to the default path's and max abs
    output diff. Back to the default afterwards (``reset_attention_backend`` alone leaves the dispatcher's active
    backend set)."""
    model, device = scale.model, scale.device
    model.set_attention_backend(backend)
    try:
        total, outputs = timed_rollout(model, latents, scale.prompt, device)
    finally:
        model.set_attention_backend("native")
        model.reset_attention_backend()
    eager_total, eager_outputs = eager["static"]
    diff = (outputs.float() - eager_outputs.float()).abs().max().item()
    num_frames = video_frames(latents.shape[2])
    report(
        f"attention {backend}",
        f"rollout {total:.2f} s = {num_frames / total:.1f} frames/s (x{eager_total / total:.2f} the default path's); "
        f"max abs diff {diff:.3e} (|out| max {eager_outputs.abs().max().item():.2f})",
    )


@torch.no_grad()
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--num-frames", type=int, default=81, help="pixel frames, 4k+1")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model at 32x32 (smoke test of this script)")
    parser.add_argument("--compile", action="store_true", help="row: compile_repeated_blocks(fullgraph=True) vs eager")
    parser.add_argument(
        "--cuda-graphs", action="store_true", help='row: compiled with mode="reduce-overhead" (CUDA graphs) vs eager'
    )
    parser.add_argument("--skip-compile", action="store_true", help="no compiled rows (overrides the two above)")
    parser.add_argument(
        "--policies",
        action="store_true",
        help="rows: window RoPE + EMA sink, 8-bit cache, attention bias, recompute, rolling window (eager)",
    )
    parser.add_argument(
        "--weights", choices=("float8", "int8"), default=None,
        help="row: the transformer loaded under TorchAoConfig (float8: CUDA cc >= 8.9) vs the compute dtype",
    )  # fmt: skip
    parser.add_argument(
        "--attention-backends", default="",
        help="rows: set_attention_backend(name) for each comma-separated name (diffusers' AttentionBackendName)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    config = TINY if args.tiny else WAN_1_3B
    height, width = (32, 32) if args.tiny else (args.height, args.width)
    latent_frames = (args.num_frames - 1) // 4 + 1
    chunk = CHUNK
    script_start = time.perf_counter()

    torch.manual_seed(0)
    with torch.device(device):
        model = WanCausalTransformer3DModel(**config, chunk_size=chunk).to(dtype).eval()
    tokens_per_frame = (height // 16) * (width // 16)
    latents = torch.randn(1, 16, latent_frames, height // 8, width // 8, device=device, dtype=dtype)
    prompt = torch.randn(1, 512, config["text_dim"], device=device, dtype=dtype)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(
        f"{config['num_layers']} layers, {config['num_attention_heads']}x{config['attention_head_dim']} heads, "
        f"{weights / 2**30:.2f} GiB weights ({args.dtype}); {args.num_frames} frames at {width}x{height} = "
        f"{latent_frames} latent frames x {tokens_per_frame} tokens; chunks of {chunk}; {device}; torch "
        f"{torch.__version__}",
        flush=True,
    )
    formula = expected_self_cache_bytes(
        config["num_layers"], 1, config["num_attention_heads"], latent_frames * tokens_per_frame,
        config["attention_head_dim"], dtype,
    )  # fmt: skip
    eager = {}

    # 1. Rollout speed and memory, per engine.
    def eager_rollout(kind: str) -> None:
        model.set_kv_cache_engines(make_engines(model, kind, max_frames=latent_frames))
        rollout(model, latents[:, :, : 2 * chunk], prompt, chunk, device)  # warm-up (kernels, allocator)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times, outputs = rollout(model, latents, prompt, chunk, device)
        total = sum(times)
        eager[kind] = (total, outputs)
        held = model.kv_cache_bytes()
        line = (
            f"[{kind}] rollout {total:.2f} s = {args.num_frames / total:.1f} frames/s; first chunk {times[0]:.3f} s, "
            f"last {times[-1]:.3f} s; K/V cache {held / 2**30:.3f} GiB vs formula {formula / 2**30:.3f} GiB "
            f"(ratio {held / formula:.3f})"
        )
        if device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(device)
            line += f"; peak {peak / 2**30:.2f} GiB = weights + cache + {(peak - weights - held) / 2**30:.2f} GiB"
        print(line, flush=True)

    for kind in ("static", "vanilla"):
        section(kind, eager_rollout, kind)

    # 2. Block-causal multi-chunk call: FlexAttention BlockMask vs SDPA boolean mask (2 chunks, no prefix).
    def flex_vs_sdpa() -> None:
        model.set_kv_cache_engines(make_engines(model, "vanilla"))
        two_chunks = latents[:, :, : 2 * chunk]
        timestep = torch.full((1,), 500.0, device=device)
        outputs = {}
        for backend in ("sdpa", "flex"):
            model.clear_caches()
            model.set_block_mask_backend(backend)
            outputs[backend] = model(two_chunks, timestep, prompt, return_dict=False)[0].float()
        model.set_block_mask_backend("auto")
        diff = (outputs["flex"] - outputs["sdpa"]).abs().max().item()
        print(
            f"flex vs sdpa block mask: max abs diff {diff:.3e} (|out| max {outputs['sdpa'].abs().max().item():.2f})",
            flush=True,
        )

    section("flex vs sdpa", flex_vs_sdpa)

    # 3. Cache policies, eager and before the compiled rows (which compile the blocks in place).
    scale = Scale(model, prompt, device, dtype, (height // 8, width // 8), tokens_per_frame, args.tiny)
    if args.policies:
        section("window rope", window_rope_part, scale)
        section("kv8", kv8_part, scale, latents, eager)
        section("bias", bias_part, scale, 2 if args.tiny else 5)
        section("recompute", recompute_part, scale)
        section("rolling", rolling_part, scale)

    # 4. Quantized weights and attention backends, eager (and the quantized blocks compiled with --compile).
    compiled = {}
    if args.weights:
        compile_too = args.compile and not args.skip_compile
        section(f"weights {args.weights}", weights_part, scale, args.weights, latents, eager, compiled, compile_too)
    for backend in filter(None, args.attention_backends.split(",")):
        section(f"attention {backend}", backend_part, scale, backend, latents, eager)

    # 5./6. Compiled rollouts (static engine): the repeated block compiled with fullgraph=True, then CUDA graphs.
    def compiled_rollout(label: str, mode: str | None) -> None:
        import torch._dynamo
        from torch._dynamo.utils import counters

        torch._dynamo.reset()
        counters.clear()
        if mode == "reduce-overhead":  # one recording per block and graph: 30 blocks x 3 graphs at 1.3B scale
            import torch._inductor.config

            torch._inductor.config.triton.cudagraph_unexpected_rerecord_limit = 1024
        model.compile_repeated_blocks(fullgraph=True, mode=mode)
        model.set_kv_cache_engines(make_engines(model, "static", max_frames=latent_frames))
        mark_steps = mode == "reduce-overhead" and device.type == "cuda"
        synchronize(device)
        begin = time.perf_counter()
        rollout(model, latents, prompt, chunk, device, mark_steps)  # compiles (and records CUDA graphs)
        first = time.perf_counter() - begin
        graphs = graph_count()
        times, outputs = rollout(model, latents, prompt, chunk, device, mark_steps)
        total = sum(times)
        compiled[label] = total
        eager_total, eager_outputs = eager["static"]
        diff = (outputs.float() - eager_outputs.float()).abs().max().item()
        print(
            f"[{label}] rollout {total:.2f} s = {args.num_frames / total:.1f} frames/s ({eager_total / total:.2f}x "
            f"eager static); first rollout (compile) {first:.1f} s; graphs {graphs}, new in the second rollout "
            f"{graph_count() - graphs}; graph breaks {sum(counters['graph_break'].values())}; max abs diff vs eager "
            f"{diff:.3e} (|out| max {eager_outputs.abs().max().item():.2f})",
            flush=True,
        )

    if not args.skip_compile and args.compile:
        section("compile", compiled_rollout, "compile", None)
    if not args.skip_compile and args.cuda_graphs:
        section("cuda graphs", compiled_rollout, "cuda graphs", "reduce-overhead")
    quantized = f"weights {args.weights}"
    if quantized in compiled and "compile" in compiled:
        ratio = compiled["compile"] / compiled[quantized]
        report(quantized, f"compiled vs compiled {args.dtype}: frames/s x{ratio:.2f} (same run, same rollout)")
    print(f"total {time.perf_counter() - script_start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
