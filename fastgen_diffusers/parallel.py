"""Ulysses context parallelism for the causal Wan models, on diffusers' ``enable_parallelism``.

Layout. Under ``ContextParallelConfig(ulysses_degree=P)`` every rank runs the same forward on the same inputs. The
model cuts **every latent frame** of a call into ``P`` equal runs of tokens and keeps run ``r`` on rank ``r``
(:func:`shard_frames`): a rank holds ``(B, F * S/P, D)`` tokens, ``S/P`` of each of the ``F`` frames, so the per-frame
AdaLN modulation and the output head run on the shard unchanged. Cutting the flattened sequence into contiguous runs
(what diffusers' ``_cp_plan`` hooks do) would split frames across ranks.

Self-attention (:func:`sequence_to_heads`, :func:`heads_to_sequence`). The processor exchanges the current call's
q/k/v with one all-to-all each (diffusers' ``SeqAllToAllDim``): sequence-sharded with all ``H`` heads becomes the
whole call (every frame, in frame order) for the ``H/P`` heads of the rank. That is exactly what one process computes
for those heads, so the rank's engine caches the prefix of its own heads, attends with the single-process code (the
block masks and windows included) and sends the output back with one more all-to-all. The cache never moves: the
traffic per forward is the current call only, and each rank holds ``1/P`` of the self-attention cache.

Cross-attention needs no exchange: a rank's query shard attends to the whole text with all heads (as diffusers'
``WanAttnProcessor`` does under context parallelism), and every rank caches the same cross K/V.

The output head's projection is all-gathered per frame (:func:`gather_frames`), so every rank returns the whole
prediction and the rollouts of all ranks stay identical.

Ring attention is refused (:func:`check_context_parallel_config`): diffusers' ring all-gathers every rank's K/V and
merges per-shard results with their log-sum-exp inside one attention call. A cache cannot live inside that op (it
runs once per K/V shard), so it would have to be kept outside as sequence shards and all-gathered, whole, at every
forward: traffic and peak memory would grow with the prefix and the memory saving would be gone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from diffusers.hooks.context_parallel import EquipartitionSharder
from diffusers.models._modeling_parallel import ContextParallelConfig
from diffusers.models.attention_dispatch import SeqAllToAllDim

CONTEXT_PARALLEL_MODES = ("ulysses",)


def context_parallel_config(module: torch.nn.Module | object) -> ContextParallelConfig | None:
    """The ``ContextParallelConfig`` a model (``_parallel_config`` set by ``enable_parallelism``) or an attention
    processor (``_parallel_config`` set on it by the same call) runs under, or ``None``."""
    parallel_config = getattr(module, "_parallel_config", None)
    return None if parallel_config is None else parallel_config.context_parallel_config


def check_context_parallel_config(config: ContextParallelConfig, num_heads: int) -> None:
    """Raise ``ValueError`` for a context-parallel configuration a cached causal rollout cannot serve.

    Runs before diffusers builds the device mesh, so a refused configuration leaves the model untouched.
    """
    if config.ring_degree > 1:
        raise ValueError(
            f"Ring attention (`ring_degree={config.ring_degree}`) is not supported for KV-cached causal rollouts: "
            "diffusers' ring attention all-gathers every rank's K/V and merges per-shard results by log-sum-exp "
            "inside a single attention call, so a cache cannot live inside it; kept outside, the whole cached prefix "
            "would be all-gathered again at every forward (traffic and peak memory growing with the video) and the "
            "per-rank memory saving would be lost. Use `ContextParallelConfig(ulysses_degree=N)`: each rank then "
            "caches the prefix of its own heads and only the current chunk is exchanged."
        )
    if config.ulysses_anything:
        raise ValueError(
            "`ulysses_anything=True` is not supported by the causal models: the heads and the tokens per latent frame "
            "must divide evenly by `ulysses_degree` (each rank caches the prefix of an equal share of the heads)."
        )
    if num_heads % config.ulysses_degree:
        raise ValueError(
            f"Ulysses context parallelism splits the attention heads across ranks: the model has {num_heads} heads, "
            f"which do not divide by `ulysses_degree={config.ulysses_degree}`. Use a degree that divides {num_heads}."
        )


def check_frame_tokens(frame_seqlen: int, config: ContextParallelConfig) -> None:
    """Raise ``ValueError`` unless the tokens of a latent frame divide evenly across the Ulysses ranks."""
    if frame_seqlen % config.ulysses_degree:
        raise ValueError(
            f"Under Ulysses context parallelism every latent frame is split evenly across the "
            f"{config.ulysses_degree} ranks, but a frame has {frame_seqlen} tokens (post-patch height x width), so a "
            f"chunk's tokens cannot be split either. Use a resolution whose token grid per frame divides by "
            f"{config.ulysses_degree} (Wan 480p: 30 x 52 = 1560 tokens)."
        )


def _rank_in(mesh) -> int:
    return dist.get_rank(mesh.get_group())


def shard_frames(tokens: torch.Tensor, num_frames: int, config: ContextParallelConfig) -> torch.Tensor:
    """This rank's tokens of every frame: ``(B, F*S, ...)`` to ``(B, F*S/P, ...)`` (a view; no communication)."""
    per_frame = tokens.unflatten(1, (num_frames, -1))
    return EquipartitionSharder.shard(per_frame, 2, config._ulysses_mesh).flatten(1, 2)


def gather_frames(tokens: torch.Tensor, num_frames: int, config: ContextParallelConfig) -> torch.Tensor:
    """Inverse of :func:`shard_frames` (an all-gather): ``(B, F*S/P, C)`` on every rank to ``(B, F*S, C)``."""
    per_frame = tokens.unflatten(1, (num_frames, -1))
    return EquipartitionSharder.unshard(per_frame, 2, config._ulysses_mesh).flatten(1, 2)


def sequence_to_heads(tensor: torch.Tensor, num_frames: int, config: ContextParallelConfig) -> torch.Tensor:
    """All-to-all ``(B, F*S/P, H, D)`` (this rank's tokens of each frame, all heads) to ``(B, F*S, H/P, D)`` (every
    token in frame order, the rank's block of heads): what one process holds for those heads."""
    world = config.ulysses_degree
    gathered = SeqAllToAllDim.apply(config._ulysses_mesh.get_group(), tensor, 2, 1)  # (B, P*F*S/P, H/P, D), rank-major
    return gathered.unflatten(1, (world, num_frames, -1)).transpose(1, 2).flatten(1, 3)


def heads_to_sequence(tensor: torch.Tensor, num_frames: int, config: ContextParallelConfig) -> torch.Tensor:
    """Inverse of :func:`sequence_to_heads`: ``(B, F*S, H/P, D)`` to ``(B, F*S/P, H, D)``."""
    world = config.ulysses_degree
    rank_major = tensor.unflatten(1, (num_frames, world, -1)).transpose(1, 2).flatten(1, 3).contiguous()
    return SeqAllToAllDim.apply(config._ulysses_mesh.get_group(), rank_major, 1, 2)


def is_main_process(module: torch.nn.Module) -> bool:
    """Whether this process leads ``module``'s context-parallel group (rank 0 in it), or runs without one."""
    config = context_parallel_config(module)
    return config is None or _rank_in(config._flattened_mesh) == 0


@dataclass
class ContextParallelSetup:
    """What :func:`setup_context_parallel` set up: this process's ``rank`` of ``world_size``, its ``device``, and
    whether it is the ``main`` process (the one that decodes and writes)."""

    rank: int
    world_size: int
    device: torch.device
    main: bool


def setup_context_parallel(pipe, mode: str = "ulysses") -> ContextParallelSetup:
    """Set up a causal Wan pipeline for context parallelism under ``torchrun --nproc_per_node=N`` (a GPU per process).

    Initializes the default process group from torchrun's environment (NCCL on CUDA) if needed, moves the pipeline to
    ``cuda:LOCAL_RANK`` and enables Ulysses on ``pipe.transformer`` over all ``N`` processes. Every process must then
    run the same call with the same generator seed; the pipeline returns frames on the main process and the latents,
    undecoded, on the others.

    Args:
        pipe: a causal Wan pipeline (its transformer has the causal processors installed).
        mode: ``"ulysses"`` (the only mode cached rollouts support).

    Returns:
        A [`ContextParallelSetup`].
    """
    if mode not in CONTEXT_PARALLEL_MODES:
        raise ValueError(
            f"`--context-parallel` must be one of {CONTEXT_PARALLEL_MODES}, got {mode!r} (ring attention cannot serve "
            "a KV-cached rollout; see fastgen_diffusers.parallel)."
        )
    if "WORLD_SIZE" not in os.environ or "LOCAL_RANK" not in os.environ:
        raise RuntimeError(
            "Context parallelism runs one process per GPU: launch with `torchrun --nproc_per_node=N ...` (torchrun "
            "sets WORLD_SIZE, RANK and LOCAL_RANK)."
        )
    if not torch.cuda.is_available():
        raise RuntimeError(
            "Context parallelism needs one accelerator per process: diffusers' `enable_parallelism` places each "
            "rank on `rank % torch.accelerator.device_count()`, which fails without one."
        )
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=device)
    world_size = dist.get_world_size()
    pipe.to(device)
    pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=world_size))
    main = is_main_process(pipe.transformer)
    pipe.set_progress_bar_config(disable=not main)
    return ContextParallelSetup(dist.get_rank(), world_size, device, main)
