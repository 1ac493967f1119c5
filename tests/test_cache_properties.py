"""Property: random sequences of engine operations, invalid calls interleaved, against a fresh-model oracle.

After every invalid call (refused before any work, or failing midway) the cache is exactly what it was; after every
valid call the output equals a fresh model's full forward over the frames the cache stands for (no cache, the same
window). Both engines, with and without a window and sink, two tags, chunks of 1 and 2 frames, stores, rewinds.
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field

import pytest
import torch
from cache_state import assert_same_state, model_state
from conftest import make_causal_transformer
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from fastgen_diffusers import make_engines

MAX_FRAMES = 8
TAGS = ("pos", "neg")
WINDOWS = {1: [(None, 0), (2, 0), (3, 1)], 2: [(None, 0), (4, 0), (5, 2)]}  # chunk size -> (window, sink)
BAD = ("text width", "text dtype", "zero tokens", "channels", "negative start", "hole", "timestep", "meta")


@functools.cache
def models(chunk_size: int):
    """The model under test and the oracle (same weights; its engine is emptied before every use)."""
    model = make_causal_transformer(chunk_size=chunk_size, num_layers=2)
    return model, copy.deepcopy(model)


@functools.cache
def prompt(tag: str) -> torch.Tensor:
    return torch.randn(1, 3, 32, generator=torch.Generator().manual_seed(len(tag) + 10 * (tag == "neg")))


@dataclass
class Expected:
    """What the cache must stand for: per tag, the latents and per-frame timesteps of every stored frame, and the
    first frame the window has evicted up to (the documented rule, restated here as the oracle's bookkeeping)."""

    window: int | None
    sink: int
    latents: dict = field(default_factory=dict)  # tag -> (1, C, n, 2, 2)
    timesteps: dict = field(default_factory=dict)  # tag -> (1, n)
    evicted_before: dict = field(default_factory=dict)

    def stored(self, tag: str) -> int:
        return 0 if tag not in self.latents else self.latents[tag].shape[2]

    def serves(self, tag: str, start: int, first_chunk: int) -> bool:
        if self.window is None:
            return True
        recent = min(max(min(self.sink, start), start + first_chunk - (self.window - self.sink)), start)
        return not (recent < start and recent < self.evicted_before.get(tag, 0))

    def record(self, tag: str, start: int, first_chunk: int, latents, timesteps, store: bool) -> None:
        if self.window is None:
            if store:
                self._store(tag, start, latents, timesteps)
            return
        room = self.window - self.sink
        evicted = self.evicted_before.get(tag, 0)
        if tag in self.latents and start + first_chunk - room > max(self.sink, evicted):
            evicted = start + first_chunk - room
        if store:
            end = start + latents.shape[2]
            evicted = max(min(evicted, start), max(self.sink, end - room))
            self._store(tag, start, latents, timesteps)
        if tag in self.latents or store:
            self.evicted_before[tag] = evicted

    def _store(self, tag, start, latents, timesteps) -> None:
        if tag not in self.latents:
            self.latents[tag], self.timesteps[tag] = latents[:, :, :0], timesteps[:, :0]
        self.latents[tag] = torch.cat([self.latents[tag][:, :, :start], latents], dim=2)
        self.timesteps[tag] = torch.cat([self.timesteps[tag][:, :start], timesteps], dim=1)

    def rewind(self, tag: str, frames: int) -> None:
        if not frames:
            return
        end = self.stored(tag) - frames
        self.latents[tag], self.timesteps[tag] = self.latents[tag][:, :, :end], self.timesteps[tag][:, :end]
        self.evicted_before[tag] = min(self.evicted_before.get(tag, 0), end)


def oracle_output(oracle, expected: Expected, tag, start, latents, timesteps) -> torch.Tensor:
    """A fresh model's full forward over the stored frames before ``start`` and this call's frames."""
    for engine in oracle.kv_cache_engines.values():
        engine.clear()
    if start:
        latents = torch.cat([expected.latents[tag][:, :, :start], latents], dim=2)
        timesteps = torch.cat([expected.timesteps[tag][:, :start], timesteps], dim=1)
    return oracle(latents, timesteps, prompt(tag), return_dict=False)[0][:, :, start:]


def bad_call(kind: str, call: dict, stored: int, chunk_size: int) -> dict:
    hidden, text = call["hidden_states"], call["encoder_hidden_states"]
    changes = {
        "text width": dict(encoder_hidden_states=text[..., :16]),
        "text dtype": dict(encoder_hidden_states=text.double()),
        "zero tokens": dict(encoder_hidden_states=text[:, :0]),
        "channels": dict(hidden_states=hidden[:, :8]),
        "negative start": dict(start_frame=-chunk_size),
        "hole": dict(start_frame=stored + chunk_size),
        "timestep": dict(timestep=call["timestep"] + 1001.0),
        "meta": dict(hidden_states=torch.empty(hidden.shape, device="meta")),
    }
    return {**call, **changes[kind]}


call_operation = st.tuples(
    st.just("call"),
    st.sampled_from(TAGS),
    st.integers(0, 8),  # which chunk boundary to start at
    st.integers(1, 3),  # chunks in the call
    st.booleans(),  # store_kv
    st.integers(0, 2**16),  # seed of the latents and timesteps
    st.sampled_from([None, None, None, None, 0, 1]),  # block that raises midway (None: none)
)
operation = st.one_of(
    call_operation,
    call_operation,
    call_operation,
    st.tuples(st.just("bad"), st.sampled_from(TAGS), st.sampled_from(BAD), st.booleans()),
    st.tuples(st.just("rewind"), st.sampled_from(TAGS), st.integers(0, 3)),
)


def fail_in_block(model, index: int):
    def fail(module, args):
        raise RuntimeError("injected failure")

    return model.blocks[index].register_forward_pre_hook(fail)


def run_sequence(chunk_size: int, kind: str, window_index: int, operations: list, event=event) -> None:
    """Run ``operations`` (``event``: hypothesis's, or a no-op outside a hypothesis test)."""
    model, oracle = models(chunk_size)
    window, sink = WINDOWS[chunk_size][window_index]
    options = {"window_frames": window, "sink_frames": sink}
    model.set_kv_cache_engines(make_engines(model, kind, **options))
    oracle.set_kv_cache_engines(make_engines(oracle, "vanilla", **options))
    engine = model.kv_cache_engines["main"]
    expected = Expected(window, sink)
    for op in operations:
        tag = op[1]
        stored = expected.stored(tag)
        if op[0] == "rewind":
            frames = min(op[2], stored // chunk_size) * chunk_size
            engine.rewind(tag, frames)
            expected.rewind(tag, frames)
            assert engine.num_stored_frames(tag) == expected.stored(tag)
            continue
        if op[0] == "call":
            _, _, boundary, chunks, store, seed, failing_block = op
            start = chunk_size * (boundary % (stored // chunk_size + 1))
        else:
            _, _, bad, store = op
            start, chunks, seed, failing_block = stored, 1, 0, None
        num_frames = max(chunk_size, min(chunks * chunk_size, MAX_FRAMES - start))
        gen = torch.Generator().manual_seed(seed)
        latents = torch.randn(1, 16, num_frames, 2, 2, generator=gen)
        timesteps = torch.randint(0, 5, (1, num_frames), generator=gen).float() * 250.0
        call = dict(
            hidden_states=latents,
            timestep=timesteps,
            encoder_hidden_states=prompt(tag),
            start_frame=start,
            cache_tag=tag,
            store_kv=store,
            return_dict=False,
        )
        valid = op[0] == "call" and expected.serves(tag, start, chunk_size)
        if valid and failing_block is None:
            output = model(**call)[0]
            reference = oracle_output(oracle, expected, tag, start, latents, timesteps)
            assert (output - reference).abs().max().item() <= 1e-4
            event("valid call matched the oracle" + (" (store)" if store else ""))
            expected.record(tag, start, chunk_size, latents, timesteps, store)
            assert engine.num_stored_frames(tag) == expected.stored(tag)
            continue
        before = model_state(model)
        handle = None if failing_block is None else fail_in_block(model, failing_block)
        try:
            try:
                model(**(call if op[0] == "call" else bad_call(bad, call, stored, chunk_size)))
            except (ValueError, RuntimeError) as error:
                event(f"invalid call refused: {type(error).__name__}")
            else:
                raise AssertionError(f"{op} was served")
        finally:
            if handle is not None:
                handle.remove()
        assert_same_state(before, model_state(model))


@settings(
    max_examples=1000,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    chunk_size=st.sampled_from([1, 2]),
    kind=st.sampled_from(["static", "vanilla"]),
    window_index=st.integers(0, 2),
    operations=st.lists(operation, min_size=1, max_size=12),
)
@torch.no_grad()
def test_random_operation_sequences_match_a_fresh_model_and_invalid_calls_change_nothing(
    chunk_size, kind, window_index, operations
):
    run_sequence(chunk_size, kind, window_index, operations)


@pytest.mark.parametrize("kind", ["static", "vanilla"])
@torch.no_grad()
def test_a_rewind_past_the_held_chunks_to_an_evicted_boundary(kind):
    """Chunks of 1, window 2, no sink: frame 0, then frames 1..3 in one call (the window evicts frames 0 and 1 and
    forgets the chunk start at frame 1), then a rewind of 3 frames to frame 1 works (it cuts no held chunk) and the
    calls after it still match the oracle; a truncation inside a held chunk is still refused, before any change."""
    run_sequence(1, kind, 1, [("call", "pos", 0, 1, True, 1, None), ("call", "pos", 1, 3, True, 2, None)], print)
    engine = models(1)[0].kv_cache_engines["main"]
    assert engine.tag_state("pos").chunk_starts == [0, 2, 3]
    operations = [
        ("call", "pos", 0, 1, True, 1, None),
        ("call", "pos", 1, 3, True, 2, None),
        ("rewind", "pos", 3),
        ("call", "pos", 1, 1, True, 3, None),  # needs the evicted frame 0: refused
        ("call", "pos", 0, 2, True, 4, None),
        ("rewind", "pos", 1),
        ("call", "pos", 1, 1, False, 5, None),
    ]
    run_sequence(1, kind, 1, operations, print)
    assert models(1)[0].kv_cache_engines["main"].num_stored_frames("pos") == 1


@torch.no_grad()
def test_a_truncation_inside_a_held_chunk_is_refused_before_any_change():
    model = models(2)[0]
    model.set_kv_cache_engines(make_engines(model, "static", window_frames=4))
    engine = model.kv_cache_engines["main"]
    call = dict(timestep=torch.zeros(1, 4), encoder_hidden_states=prompt("pos"), store_kv=True, return_dict=False)
    model(torch.randn(1, 16, 4, 2, 2), start_frame=0, **call)
    model(torch.randn(1, 16, 4, 2, 2), start_frame=4, **call)  # evicts frames 0..3; holds the chunks at 4 and 6
    before = model_state(model)
    with pytest.raises(ValueError, match="Cannot truncate cache_tag 'pos' at frame 5"):
        engine.truncate("pos", 5)
    assert_same_state(before, model_state(model))
    engine.truncate("pos", 3)  # inside an evicted chunk: the tag holds nothing before it
    assert engine.num_stored_frames("pos") == 3 and engine.held_frames("pos") == 0
