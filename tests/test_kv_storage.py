"""One contract, every self-attention storage: the same test class runs over the preallocated slots, the chunk list
and the 8-bit store (either layout with an 8-bit codec)."""

from __future__ import annotations

import pytest
import torch

from fastgen_diffusers.kv_cache.storage import (
    PLAIN,
    ChunkListStorage,
    KVStorage,
    QuantizedCodec,
    SlotStorage,
    StorageLayout,
)

SEQLEN, HEADS, DIM = 2, 2, 4
LAYOUT = StorageLayout(1, SEQLEN, HEADS, DIM, torch.float32, torch.device("cpu"))
STORAGES = {
    "slots": (SlotStorage, PLAIN),
    "chunk list": (ChunkListStorage, PLAIN),
    "slots int8": (SlotStorage, QuantizedCodec(torch.int8)),
    "chunk list int8": (ChunkListStorage, QuantizedCodec(torch.int8)),
}


def frames(first: int, count: int, scale: float = 1.0) -> torch.Tensor:
    """K or V of frames ``first .. first + count - 1``: every element of frame ``f`` is ``scale * (f + 1)`` (exact in
    8 bits: one value per frame and head)."""
    values = torch.arange(first + 1, first + count + 1, dtype=torch.float32) * scale
    return values.repeat_interleave(SEQLEN)[None, :, None, None].expand(1, count * SEQLEN, HEADS, DIM).contiguous()


def held(storage: KVStorage, first: int, last: int) -> torch.Tensor:
    keys, _ = storage.read([(first, last)])
    return torch.cat(keys, dim=1)


@pytest.fixture(params=list(STORAGES))
def storage(request) -> KVStorage:
    storage_class, codec = STORAGES[request.param]
    storage = storage_class(LAYOUT, codec, 4)
    storage.reserve(8)
    return storage


class TestStorageContract:
    """What the engine relies on, for every storage alike."""

    def test_a_write_reads_back_in_the_compute_dtype(self, storage):
        storage.write(0, frames(0, 3), frames(0, 3, -1.0))
        keys, values = storage.read([(0, 3)])
        assert all(t.dtype == torch.float32 for t in (*keys, *values))
        assert torch.equal(torch.cat(keys, dim=1), frames(0, 3))
        assert torch.equal(torch.cat(values, dim=1), frames(0, 3, -1.0))

    def test_reads_of_several_ranges_come_in_order(self, storage):
        storage.write(0, frames(0, 2), frames(0, 2))
        storage.write(2, frames(2, 3), frames(2, 3))
        keys, _ = storage.read([(0, 1), (3, 5)])
        assert torch.equal(torch.cat(keys, dim=1), torch.cat([frames(0, 1), frames(3, 2)], dim=1))
        assert storage.read([(1, 1)]) == ([], [])

    def test_a_write_replaces_only_its_slots(self, storage):
        storage.write(0, frames(0, 4), frames(0, 4))
        storage.write(1, frames(10, 2), frames(10, 2))
        assert torch.equal(held(storage, 0, 4), torch.cat([frames(0, 1), frames(10, 2), frames(3, 1)], dim=1))

    def test_evict_and_truncate_keep_the_other_slots(self, storage):
        storage.write(0, frames(0, 6), frames(0, 6))
        storage.evict(1, 3)
        storage.truncate(5)
        assert torch.equal(held(storage, 0, 1), frames(0, 1))
        assert torch.equal(held(storage, 3, 5), frames(3, 2))

    def test_a_copy_is_independent(self, storage):
        storage.write(0, frames(0, 2), frames(0, 2))
        fork = storage.copy()
        storage.write(0, frames(5, 2), frames(5, 2))
        assert torch.equal(held(fork, 0, 2), frames(0, 2))
        assert torch.equal(held(storage, 0, 2), frames(5, 2))

    def test_a_snapshot_gives_the_storage_back(self, storage):
        storage.write(0, frames(0, 2), frames(0, 2))
        restore = storage.snapshot()
        undo = storage.saved(0, 2)
        storage.write(0, frames(7, 2), frames(7, 2))
        if undo is not None:  # a storage written in place undoes the write; the others keep the snapshot
            undo()
        assert torch.equal(held(restore(), 0, 2), frames(0, 2))

    def test_map_keys_rotates_keys_only(self, storage):
        storage.write(0, frames(0, 2), frames(0, 2))
        storage.map_keys(lambda key: 2 * key)
        keys, values = storage.read([(0, 2)])
        assert torch.equal(torch.cat(keys, dim=1), frames(0, 2, 2.0))
        assert torch.equal(torch.cat(values, dim=1), frames(0, 2))

    def test_byte_counts_and_clear(self, storage):
        storage.write(0, frames(0, 2), frames(0, 2))
        per_element = 1 if storage.codec.storage_dtype is not None else 4
        stored_slots = storage.num_slots
        data = 2 * stored_slots * SEQLEN * HEADS * DIM * per_element
        scales = 2 * stored_slots * HEADS * 4 if storage.codec.storage_dtype is not None else 0
        assert storage.nbytes == data + scales
        quantized = storage.codec.storage_dtype is not None
        held = 2 * 2 * SEQLEN * HEADS * DIM * per_element + (2 * 2 * HEADS * 4 if quantized else 0)
        assert storage.held_bytes(2) == held  # two slots held, whatever the capacity
        storage.clear()
        if not storage.fixed_slots:
            assert storage.nbytes == 0 and storage.num_slots == 0

    def test_a_view_in_place_is_the_compute_dtype_slots_or_none(self, storage):
        storage.write(0, frames(0, 2), frames(0, 2))
        view = storage.view()
        if view is None:  # read through `read` (runs, or 8-bit data)
            return
        key, value = view
        assert key.dtype == torch.float32 and torch.equal(key[:, : 2 * SEQLEN], frames(0, 2))
        key[:, :SEQLEN] = frames(9, 1)  # attention writes a call's K/V in place
        assert torch.equal(held(storage, 0, 1), frames(9, 1))

    def test_reserve_grows_and_keeps_what_is_held(self, storage):
        storage.write(0, frames(0, 2), frames(0, 2))
        storage.reserve(32)
        storage.write(20, frames(20, 1), frames(20, 1))
        assert torch.equal(held(storage, 0, 2), frames(0, 2))
        assert torch.equal(held(storage, 20, 21), frames(20, 1))


def test_the_model_and_processors_never_ask_which_storage_they_have():
    """One path: the attention inputs and the processors go through the engine's plan and cache views; no name of the
    static variant (its plan, buffers, store or flag) appears in their code."""
    import pathlib
    import re

    package = pathlib.Path(__file__).resolve().parents[1] / "fastgen_diffusers"
    for relative in ("models/attention_inputs.py", "processors/attention.py", "context.py"):
        code = (package / relative).read_text()
        assert not re.search(
            r"static_call|static_buffers|commit_static_store|\.static\b|isinstance\([^)]*Storage", code
        )


def test_both_cache_views_return_what_attention_reads():
    """A storage read in place and a gathered prefix hand attention the same keys for the same frames."""
    from fastgen_diffusers.kv_cache.plan import PrefixView, SlotView

    cached, call = frames(0, 2), frames(2, 1)
    buffers = [torch.zeros(1, 4 * SEQLEN, HEADS, DIM) for _ in range(2)]
    buffers[0][:, : 2 * SEQLEN], buffers[1][:, : 2 * SEQLEN] = cached, cached
    write_index = torch.arange(2 * SEQLEN, 3 * SEQLEN)
    in_place = SlotView(*buffers, write_index, torch.empty(3 * SEQLEN, 0))
    gathered = PrefixView(lambda: (cached, cached), store=True)
    gathered.load()
    for view in (in_place, gathered):
        key, value = view.attend(call, call)
        assert torch.equal(key, torch.cat([cached, call], dim=1)) and torch.equal(value, key)
    assert torch.equal(buffers[0][:, 2 * SEQLEN : 3 * SEQLEN], call)  # written into its slots
    assert torch.equal(gathered.new_key, call) and in_place.store is False  # handed back only when gathered
    with torch.no_grad():  # kept while gradients may run the block again
        gathered.release()
    assert gathered.key is None
