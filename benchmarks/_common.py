"""Set-up shared by the benchmark scripts (not a benchmark): the mid-size random transformer that the engine, cache
and 8-bit benchmarks time, the calls of one chunk, `synchronize`, `section` (a failing row is one line), torchao's
configs of the ``--weights`` choices and the bytes a (quantized) model holds.

The scripts import it as a sibling (``python benchmarks/bench_x.py`` puts this folder on ``sys.path``; the smoke tests
load them with ``tests/bench_loader.py``, which does the same).
"""

from __future__ import annotations

import torch

from fastgen_diffusers import WanCausalTransformer3DModel

CHUNK = 3  # latent frames per chunk
STEPS = (1000.0, 937.5, 833.3, 625.0)  # the students' warped 4-step schedule (model timesteps)
# dim 128 (4 heads x 32), ffn 256, 4 layers, text dim 64, chunks of 3 latent frames
MID_CONFIG = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=4,
    attention_head_dim=32,
    in_channels=16,
    out_channels=16,
    text_dim=64,
    freq_dim=256,
    ffn_dim=256,
    num_layers=4,
    chunk_size=CHUNK,
)


def mid_transformer() -> WanCausalTransformer3DModel:
    """The mid-size transformer of :data:`MID_CONFIG` with random weights (seed 0), in eval mode."""
    torch.manual_seed(0)
    return WanCausalTransformer3DModel(**MID_CONFIG).eval()


def run_chunk(model, latents: torch.Tensor, text: torch.Tensor, start: int) -> None:
    """The calls of one chunk at latent frame ``start``: the denoising steps of :data:`STEPS`, then the store."""
    device = latents.device
    for step in STEPS:
        model(latents, torch.full((1,), step, device=device), text, start_frame=start)
    model(latents, torch.zeros(1, device=device), text, start_frame=start, store_kv=True)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so that a host timer spans it; nothing to wait for elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def section(name: str, fn, *args) -> None:
    """Run one section of a benchmark; a failure is one line and the script goes on."""
    try:
        fn(*args)
    except Exception as error:  # noqa: BLE001  (a benchmark reports and continues)
        message = " ".join(str(error).split())[:300]
        print(f"[{name}] FAILED: {type(error).__name__}: {message}", flush=True)


WEIGHTS = ("compute", "float8", "int8")


def quantization_config(weights: str, device: torch.device):
    """torchao's config for ``--weights`` (``None`` for the compute dtype), the one diffusers' ``TorchAoConfig`` takes:
    float8 dynamic activation + weight per row, or int8 weight-only. FP8 matmuls need compute capability 8.9 (Ada) or
    newer: anything else is refused before any weight is built."""
    if weights not in WEIGHTS:
        raise ValueError(f"`--weights` must be one of {', '.join(WEIGHTS)}, got {weights!r}.")
    if weights == "compute":
        return None
    if weights == "float8" and (device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9)):
        raise ValueError("`--weights float8` needs a CUDA device of compute capability >= 8.9 (Ada, Hopper or newer).")
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, Int8WeightOnlyConfig, PerRow

    if weights == "float8":
        return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
    return Int8WeightOnlyConfig()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of ``model``'s parameters; a torchao-quantized one counts its inner tensors (data, scales, zeros)."""
    held = 0
    for param in model.parameters():
        names = param.__tensor_flatten__()[0] if type(param).__module__.startswith("torchao") else None
        held += sum(getattr(param, n).nbytes for n in names) if names else param.numel() * param.element_size()
    return held
