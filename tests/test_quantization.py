"""The causal transformer under diffusers' own quantization and attention backends.

* ``WanCausalTransformer3DModel.from_pretrained(..., quantization_config=TorchAoConfig(Int8WeightOnlyConfig()))`` (the
  CPU-testable torchao path; FP8 dynamic activation + weight is the same call with
  ``Float8DynamicActivationFloat8WeightConfig`` on a GPU of compute capability >= 8.9) loads every linear as int8 with
  exactly the bytes the memory plan counts, and runs a whole rollout whose error against the unquantized model is
  measured per chunk and on the final latents.
* ``pipe.transformer.set_attention_backend("native")`` (diffusers' dispatcher, which the causal processors call for
  every unmasked attention) gives the default path's latents bit for bit.

torchao makes every process that imports diffusers import it (about 5 s), so it is not in the ``test`` extra: these
tests skip without it and ``.ci/run`` installs it for a second run of this file alone.
"""

from __future__ import annotations

import pytest
import torch

from fastgen_diffusers import WanCausalTransformer3DModel
from fastgen_diffusers.memory_plan import plan_rollout_memory
from fastgen_diffusers.testing import TINY_TRANSFORMER_CONFIG, tiny_components

# wider than the tiny model (int8 rows of 128): an error representative of per-row weight quantization
CONFIG = {**TINY_TRANSFORMER_CONFIG, "num_attention_heads": 4, "ffn_dim": 256}
CALL = {"height": 32, "width": 32, "num_frames": 21, "num_inference_steps": 4, "output_type": "latent"}


def _pipeline(transformer):
    from fastgen_diffusers import WanCausalPipeline

    components = tiny_components()
    components["transformer"] = transformer
    pipe = WanCausalPipeline(**components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _chunks(pipe) -> list[torch.Tensor]:
    """The latents of every chunk of one seeded rollout."""
    prompt = torch.randn(1, 12, CONFIG["text_dim"], generator=torch.Generator().manual_seed(1))
    stream = pipe.stream(prompt_embeds=prompt, generator=torch.Generator().manual_seed(0), **CALL)
    return [record.latents for record in stream]


@pytest.fixture(scope="module")
def saved_transformer(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("transformer")
    WanCausalTransformer3DModel(**CONFIG).eval().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def reference_chunks(saved_transformer):
    return _chunks(_pipeline(WanCausalTransformer3DModel.from_pretrained(saved_transformer).eval()))


def _relative(error: torch.Tensor, reference: torch.Tensor) -> float:
    return (error.norm() / reference.norm()).item()


def test_int8_weight_only_rollout_under_torchao_config(saved_transformer, reference_chunks):
    pytest.importorskip("torchao")
    from diffusers import TorchAoConfig
    from torchao.quantization import Int8WeightOnlyConfig

    quantized = WanCausalTransformer3DModel.from_pretrained(
        saved_transformer, quantization_config=TorchAoConfig(Int8WeightOnlyConfig()), torch_dtype=torch.float32
    ).eval()
    linears = {name: m for name, m in quantized.named_modules() if isinstance(m, torch.nn.Linear)}
    kept = sorted(name for name, m in linears.items() if not type(m.weight).__module__.startswith("torchao"))
    # every linear but the time embedder's, which diffusers keeps in float32 (`_keep_in_fp32_modules`)
    assert kept == ["condition_embedder.time_embedder.linear_1", "condition_embedder.time_embedder.linear_2"]
    # bytes held = the plan's int8 weights (int8 data, float32 scale and int8 zero point per row; the rest float32)
    held = 0
    for param in quantized.parameters():
        names = param.__tensor_flatten__()[0] if type(param).__module__.startswith("torchao") else None
        held += sum(getattr(param, n).nbytes for n in names) if names else param.numel() * param.element_size()
    plan = plan_rollout_memory(
        CONFIG, height=32, width=32, num_frames=21, weight_dtype="int8", compute_dtype="float32"
    )
    assert held == plan.weights

    chunks = _chunks(_pipeline(quantized))
    errors = [_relative(q - r, r) for q, r in zip(chunks, reference_chunks)]
    final = _relative(torch.cat(chunks, 2) - torch.cat(reference_chunks, 2), torch.cat(reference_chunks, 2))
    # measured: per chunk 0.254% and 0.253%, final latents 0.253% (relative L2; max abs 7.0e-3)
    assert all(0 < error < 0.01 for error in errors), errors
    assert 0 < final < 0.01


def test_native_attention_backend_equals_the_default_path(saved_transformer, reference_chunks):
    transformer = WanCausalTransformer3DModel.from_pretrained(saved_transformer).eval()
    transformer.set_attention_backend("native")
    chunks = _chunks(_pipeline(transformer))
    assert all(torch.equal(a, b) for a, b in zip(chunks, reference_chunks))
    processors = {type(p).__name__: p._attention_backend for p in transformer.attn_processors.values()}
    assert set(processors) == {"WanCausalAttnProcessor", "WanCausalCrossAttnProcessor"}
    assert {str(backend) for backend in processors.values()} == {"AttentionBackendName.NATIVE"}


def test_gpu_scale_benchmark_measures_quantized_weights_and_backends_in_its_tiny_cpu_mode(capsys):
    """bench_gpu_scale's ``--weights`` rows (the transformer loaded under ``TorchAoConfig``: eager, compiled, and a
    sampled rollout's error per chunk and on the final latents against the compute dtype, same run) and its
    ``--attention-backends`` rows (native is the default path bit for bit; a backend whose package is missing is one
    FAILED line and the script goes on). On the GPU the same script runs ``--weights float8``."""
    pytest.importorskip("torchao")
    from bench_loader import load_benchmark

    module = load_benchmark("bench_gpu_scale")
    argv = ["--tiny", "--device", "cpu", "--dtype", "float32", "--num-frames", "21", "--weights", "int8"]
    module.main([*argv, "--compile", "--attention-backends", "native,flash"])
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.startswith("[weights int8] ")]
    assert [row.split(": ")[0].split("] ")[1].split(" (")[0] for row in rows] == [
        "eager", "compiled", "sampled rollout", "compiled vs compiled float32"
    ]  # fmt: skip
    errors = rows[2].split("per chunk ")[1].split("; final latents ")
    per_chunk, final = [float(e) for e in errors[0].split(", ")], float(errors[1])
    assert len(per_chunk) == 2 and all(0 < e < 0.01 for e in per_chunk) and 0 < final < 0.01
    native = printed.split("[attention native] ")[1].splitlines()[0]
    assert "max abs diff 0.000e+00" in native
    assert printed.count("FAILED") == 1 and "[attention flash] FAILED" in printed
    assert "(plan 0.00 GiB, ratio 1.0000)" in rows[0]  # the bytes held are the memory plan's
    module.main([*argv, "--skip-compile"])  # without compiled rows: eager and sampled only
    printed = capsys.readouterr().out
    assert "FAILED" not in printed and "[weights int8] sampled rollout" in printed


def test_end_to_end_benchmark_quantizes_the_linears_diffusers_does():
    """bench_end_to_end builds its 14B transformer block by block under ``init_empty_weights`` and quantizes each
    block as it lands (``torchao.quantize_``): the linears ``TorchAoConfig`` converts, the time embedder's kept."""
    pytest.importorskip("torchao")
    from accelerate import init_empty_weights
    from bench_loader import load_benchmark

    module = load_benchmark("bench_end_to_end")
    with init_empty_weights():
        transformer = WanCausalTransformer3DModel(**CONFIG)
    module.materialize(transformer, torch.device("cpu"), torch.float32, module.quantization_config("int8", "cpu"))
    linears = {name: m for name, m in transformer.named_modules() if isinstance(m, torch.nn.Linear)}
    kept = sorted(name for name, m in linears.items() if not type(m.weight).__module__.startswith("torchao"))
    assert kept == ["condition_embedder.time_embedder.linear_1", "condition_embedder.time_embedder.linear_2"]
    assert len(linears) > len(kept) and not any(p.is_meta for p in transformer.parameters())
