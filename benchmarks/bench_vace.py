"""Exact vs lossy VACE hint reuse in the causal VACE rollout (``vace_hint_refresh_interval`` K = 1, 2, 4).

Prints, per K, the fastest wall time of the chunk rollout (the VAE is left out: it is the same for every K), the
speed-up over the exact path and the mean / max absolute difference of the final latents against it. The model is a
random ~1/10-width Wan VACE with one VACE layer per three layers (Wan2.1-VACE-1.3B: 15 VACE layers for 30 blocks).

    python benchmarks/bench_vace.py [--steps 4] [--repeats 7] [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import PIL.Image
import torch

from fastgen_diffusers import WanCausalVACEPipeline, WanCausalVACETransformer3DModel
from fastgen_diffusers.testing import tiny_components

CONFIG = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 4,
    "attention_head_dim": 32,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 32,
    "freq_dim": 256,
    "ffn_dim": 512,
    "num_layers": 6,
    "vace_layers": [0, 2, 4],
    "rope_max_seq_len": 1024,
    "chunk_size": 3,
}


class TimedPipeline(WanCausalVACEPipeline):
    """Records the wall time of each rollout (the denoising and cache passes, without VAE work)."""

    def run_policy(self, *args, **kwargs):
        start = time.perf_counter()
        yield from super().run_policy(*args, **kwargs)
        self.rollout_seconds = time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per chunk")
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per K (the fastest is reported)")
    parser.add_argument("--size", type=int, default=64, help="height and width in pixels")
    parser.add_argument("--num-frames", type=int, default=21, help="pixel frames (21: 6 latent frames, 2 chunks)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is steadiest on a shared host)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    components = tiny_components()
    torch.manual_seed(0)
    components["transformer"] = WanCausalVACETransformer3DModel(**CONFIG).eval()
    pipe = TimedPipeline(**components)
    pipe.set_progress_bar_config(disable=True)
    rng = np.random.RandomState(0)
    video = [
        PIL.Image.fromarray(rng.randint(0, 255, (args.size, args.size, 3), dtype=np.uint8))
        for _ in range(args.num_frames)
    ]
    common = {
        "prompt_embeds": torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(1)),
        "video": video,
        "height": args.size,
        "width": args.size,
        "num_frames": args.num_frames,
        "num_inference_steps": args.steps,
        "output_type": "latent",
    }

    def run(variant: int) -> torch.Tensor:
        latents = pipe(
            **common,
            vace_hint_refresh_interval=max(variant, 1),
            allow_lossy=variant > 1,
            generator=torch.Generator().manual_seed(0),
        ).frames
        times[variant].append(pipe.rollout_seconds)
        return latents

    # Round-robin over the variants (the first round warms up) and keep each one's fastest rollout: on a shared host
    # the minimum is the steadiest estimate of the undisturbed time.
    variants = (0, 1, 2, 4)  # 0: the default exact path (no hint cache), then K = 1, 2, 4
    times = {interval: [] for interval in variants}
    outputs = {}
    for round_index in range(args.repeats + 1):
        for interval in variants:
            outputs[interval] = run(interval)
            if round_index == 0:
                times[interval].clear()
    exact, exact_time = outputs[0], min(times[0])
    print(
        f"threads={torch.get_num_threads()} size={args.size} frames={args.num_frames} steps={args.steps} "
        f"layers={CONFIG['num_layers']} vace_layers={CONFIG['vace_layers']} (fastest of {args.repeats} runs)"
    )
    print(f"{'K':>5} {'rollout ms':>11} {'speed-up':>9} {'mean abs diff':>14} {'max abs diff':>13}")
    for interval in variants:
        diff = (outputs[interval] - exact).abs()
        seconds = min(times[interval])
        label = "exact" if interval == 0 else str(interval)
        print(
            f"{label:>5} {seconds * 1e3:11.1f} {exact_time / seconds:8.2f}x {diff.mean().item():14.2e} "
            f"{diff.max().item():13.2e}"
        )
    scale = exact.abs().mean().item()
    print(f"(mean |latent| of the exact output: {scale:.3f})")


if __name__ == "__main__":
    main()
