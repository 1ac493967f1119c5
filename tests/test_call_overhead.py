"""Per-call Python overhead removed from the forward: memoised dtype and timestep embedding, exactly as before."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_causal_transformer
from diffusers.models.modeling_utils import get_parameter_dtype
from torch.utils._python_dispatch import TorchDispatchMode


def test_dtype_is_memoised_and_follows_casts_and_layerwise_casting():
    model = make_causal_transformer()
    assert model.dtype == get_parameter_dtype(model) == torch.float32
    model.to(torch.float64)
    assert model.dtype == get_parameter_dtype(model) == torch.float64
    model.to(torch.float32)
    model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    assert model.dtype == get_parameter_dtype(model) == torch.bfloat16


@torch.no_grad()
def test_a_cfg_pair_embeds_its_timestep_once_with_the_same_numbers(latents, prompt_embeds):
    model = make_causal_transformer()
    calls = []
    model.condition_embedder.time_embedder.register_forward_hook(lambda *args: calls.append(1))
    timestep = torch.tensor([900.0, 900.0])
    pos = model(latents[:, :, :3], timestep, prompt_embeds, cache_tag="pos")[0]
    neg = model(latents[:, :, :3], timestep, -prompt_embeds, cache_tag="neg")[0]
    assert len(calls) == 1
    timestep.fill_(500.0)  # an in-place change is a new timestep
    changed = model(latents[:, :, :3], timestep, prompt_embeds, cache_tag="pos")[0]
    assert len(calls) == 2
    fresh = make_causal_transformer()
    assert torch.equal(neg, fresh(latents[:, :, :3], torch.tensor([900.0, 900.0]), -prompt_embeds)[0])
    assert torch.equal(changed, fresh(latents[:, :, :3], torch.tensor([500.0, 500.0]), prompt_embeds)[0])
    assert not torch.equal(pos, changed)


@torch.no_grad()
@pytest.mark.parametrize("change", ["numpy view", ".data"])
def test_a_timestep_changed_behind_its_version_counter_is_a_new_timestep(latents, prompt_embeds, change):
    """The timestep-embedding memo is keyed by the values the call check read, not by the tensor's identity and
    version (a NumPy view or ``.data`` changes values without a version bump: the memo once gave the old ones)."""
    model = make_causal_transformer()
    buffer = np.full(2, 900.0, dtype=np.float32)
    timestep = torch.from_numpy(buffer) if change == "numpy view" else torch.tensor([900.0, 900.0])
    before = model(latents[:, :, :3], timestep, prompt_embeds)[0]
    if change == "numpy view":
        buffer[:] = 500.0
    else:
        timestep.data.fill_(500.0)
    after = model(latents[:, :, :3], timestep, prompt_embeds)[0]
    expected = make_causal_transformer()(latents[:, :, :3], torch.tensor([500.0, 500.0]), prompt_embeds)[0]
    assert torch.equal(after, expected) and not torch.equal(before, after)


class _DeviceReads(TorchDispatchMode):
    """Logs the ops of a forward that read tensor values into the host (on an accelerator each is a synchronisation):
    scalar reads and ``torch.equal`` of tensors that are not host copies, and copies to the CPU. Host copies are the
    tensors ``read_timestep`` returned and what is computed from them only."""

    READS = {"aten._local_scalar_dense.default", "aten.equal.default", "aten.is_nonzero.default"}

    def __init__(self, host: set[int]):
        super().__init__()
        self.host, self.reads = host, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        on_host = bool(tensors) and all(t.untyped_storage().data_ptr() in self.host for t in tensors)
        out = func(*args, **kwargs)
        if str(func) in self.READS and not on_host:
            self.reads.append(str(func))
        elif str(func) == "aten._to_copy.default" and kwargs.get("device") == torch.device("cpu"):
            self.reads.append("copy to host")
        if on_host and isinstance(out, torch.Tensor):
            self.host.add(out.untyped_storage().data_ptr())
        return out


def test_a_forward_reads_the_device_at_most_twice(monkeypatch):
    """Per forward: one host copy of the timestep (its range check and the embedding memo's key) and, when the tag's
    cross K/V were filled, one comparison of the conditioning with the prompt that filled them (reuse by content).
    Both decide something on the host before any cache operation, so neither can go without dropping a check; this
    pins them (and that nothing else in a forward reads the device: the blocks are sync-free, tests/test_compile.py).
    """
    from fastgen_diffusers.models import call_checks
    from fastgen_diffusers.testing import tiny_pipeline

    pipe = tiny_pipeline()
    pipe.set_progress_bar_config(disable=True)
    host, per_forward = set(), []
    read_timestep = call_checks.read_timestep

    def reading(timestep):
        values = read_timestep(timestep)
        host.add(values.untyped_storage().data_ptr())
        return values

    forward = pipe.transformer.forward

    def logged(*args, **kwargs):
        with _DeviceReads(host) as mode:
            out = forward(*args, **kwargs)
        per_forward.append((kwargs["cache_tag"], kwargs["store_kv"], mode.reads))
        return out

    monkeypatch.setattr(call_checks, "read_timestep", reading)
    monkeypatch.setattr(pipe.transformer, "forward", logged)
    pipe(
        prompt_embeds=torch.randn(1, 8, 32),
        negative_prompt_embeds=torch.randn(1, 8, 32),
        guidance_scale=2.0,
        height=16,
        width=16,
        num_frames=21,  # chunks [0, 3) and [3, 6): 2 steps + a cache pass for chunk 0, 2 steps for chunk 1, per tag
        num_inference_steps=2,
        output_type="latent",
    )
    filled = {"pos": False, "neg": False}
    assert len(per_forward) == 10
    for tag, store_kv, reads in per_forward:
        assert reads == ["copy to host"] + (["aten.equal.default"] if filled[tag] else [])
        filled[tag] |= store_kv
