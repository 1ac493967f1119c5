"""Text-to-video with a causal Wan student on N GPUs: Ulysses context parallelism, one process per GPU.

    torchrun --nproc_per_node=2 examples/context_parallel.py --model /path/to/causal-wan --prompt "a fox in the snow"

Every process loads the pipeline, runs the same rollout with the same seed and holds 1/N of the KV cache (the cached
prefix of its share of the attention heads); only the current chunk crosses between GPUs. Process 0 decodes and
writes the video; the others get the latents back, undecoded, and exit. Nothing special is needed on the GPUs:
NCCL, one process per GPU, a head count (12 for Wan 1.3B, 40 for 14B) and a token count per latent frame
(30 x 52 = 1560 at 480p) that divide by N.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from diffusers.utils import export_to_video

from fastgen_diffusers import WanCausalPipeline
from fastgen_diffusers.parallel import setup_context_parallel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="diffusers directory or Hub id of a causal Wan student")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--output", default="output.mp4")
    parser.add_argument("--num-frames", type=int, default=81)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    pipe = WanCausalPipeline.from_pretrained(args.model, dtype=torch.bfloat16)
    setup = setup_context_parallel(pipe, "ulysses")  # process group, cuda:LOCAL_RANK, Ulysses over all processes
    pipe.vae.to(torch.float32)
    frames = pipe(
        prompt=args.prompt,
        num_frames=args.num_frames,
        generator=torch.Generator(device="cpu").manual_seed(args.seed),  # the same seed on every process
    ).frames
    if setup.main:
        export_to_video(list(frames[0]), args.output, fps=16)
        print(f"Wrote {args.output} on {setup.world_size} GPUs.")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
