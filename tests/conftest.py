from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import pytest
import torch

# Tiny models gain nothing from intra-op threads, and oversubscribed threads slow them badly on a loaded machine.
torch.set_num_threads(1)

TINY_WAN_CONFIG = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 2,
    "attention_head_dim": 32,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 32,
    "freq_dim": 256,
    "ffn_dim": 64,
    "num_layers": 2,
    "rope_max_seq_len": 1024,
}


@dataclass
class ForwardCall:
    """One ``transformer.forward`` seen by [`recorded_forwards`]: its positional ``args`` (``args[0]``: the hidden
    states), its keyword ``kwargs`` and ``out``, the first item it returned (``None`` until it returned, and for a
    store-only pass)."""

    args: tuple
    kwargs: dict[str, Any]
    out: Any = None

    @property
    def hidden_states(self):
        return self.args[0] if self.args else self.kwargs["hidden_states"]


@contextlib.contextmanager
def recorded_forwards(transformer):
    """Record every call of ``transformer.forward`` while inside (the list of [`ForwardCall`] it yields, each appended
    before the forward runs); the forward itself runs unchanged. The previous ``forward`` is restored on exit."""
    calls: list[ForwardCall] = []
    own = transformer.__dict__.get("forward")
    forward = transformer.forward

    def recording(*args, **kwargs):
        call = ForwardCall(args, kwargs)
        calls.append(call)
        out = forward(*args, **kwargs)
        call.out = out[0]
        return out

    transformer.forward = recording
    try:
        yield calls
    finally:
        if own is None:
            del transformer.forward
        else:
            transformer.forward = own


def block_self_inputs(block, args):
    """The self-attention inputs the model prepared for ``block`` in a forward (from the block's forward-pre-hook
    ``args``, whose last item is its :class:`CausalBlockView`), found the way its processor finds them."""
    view = args[-1]
    return view.prepared_inputs(view.resolve_registered_engine(block.attn1), block.attn1).self_attn


def make_causal_transformer(seed: int = 0, **overrides):
    """A tiny random causal Wan transformer with a non-degenerate output head (head_dim 32: RoPE split 12/10/10)."""
    from fastgen_diffusers import WanCausalTransformer3DModel

    torch.manual_seed(seed)
    return WanCausalTransformer3DModel(**{**TINY_WAN_CONFIG, **overrides}).eval()


@pytest.fixture
def tiny_model():
    return make_causal_transformer()


@pytest.fixture
def latents():
    """``(B=2, C=16, F=8, H=6, W=10)``: batch > 1, non-square, 15 tokens per frame, 8 frames = chunks (5, 3)."""
    return torch.randn(2, 16, 8, 6, 10, generator=torch.Generator().manual_seed(1))


@pytest.fixture
def prompt_embeds():
    return torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(2))
