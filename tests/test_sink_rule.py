"""The sink rule is one object the ledger asks (which frames are pinned, how they are updated): a rule that pins
the first frames of each segment is a small class, and the ledger's plan, eviction, positions and masks follow it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fastgen_diffusers.kv_cache import AttentionWindow
from fastgen_diffusers.kv_cache.ledger import Eviction, KeyPlan, Ledger
from fastgen_diffusers.kv_cache.masks import BlockMaskMemo, build_sdpa_mask
from fastgen_diffusers.kv_cache.positions import ROPE_POSITION_MODES, anchor_positions
from fastgen_diffusers.kv_cache.sink import SegmentSinkRule, SinkRule
from fastgen_diffusers.pipelines.rollout.prompt_switch import recache_keeping_sink
from fastgen_diffusers.pipelines.rollout.session import RolloutSession

LAYOUT = dict(batch_size=1, frame_seqlen=2, num_heads=2, head_dim=4, dtype="float32", device="cpu")


def segment_ledger(positions: str = "anchor") -> Ledger:
    """Window of 6 frames (5 of room), the first frame of the segments starting at frames 0 and 6 pinned; stored in
    chunks of 2 frames up to frame 14."""
    rule = SegmentSinkRule(1, starts=(0, 6))
    book = Ledger(AttentionWindow(6, 1), rule, ROPE_POSITION_MODES[positions], positions, fixed_slots=False)
    book.tags.create("pos", **LAYOUT)
    for start in range(0, 14, 2):
        book.begin_call("pos", start, 2)
        book.store_window("pos", start, start + 2)
        book.commit_store("pos", start, 2)
    return book


def test_a_segment_rule_pins_the_first_frames_of_each_segment():
    rule = SegmentSinkRule(2, starts=(0, 10))
    assert [f for f in range(14) if rule.pinned(f)] == [0, 1, 10, 11]
    assert rule.pinned_frames(11) == (0, 1, 10) and rule.count_before(12) == 4
    assert rule.unpinned_ranges(0, 14) == [(2, 10), (12, 14)]
    assert rule.pinned_ranges(1, 14) == [(1, 2), (10, 12)]
    # the prefix rule answers the same questions with the video's first frames
    assert SinkRule(2).pinned_frames(11) == (0, 1) and SinkRule(2).unpinned_ranges(0, 14) == [(2, 14)]
    with pytest.raises(ValueError, match="`starts`"):
        SegmentSinkRule(2, starts=(0, 1))
    with pytest.raises(ValueError, match="`update`"):
        SegmentSinkRule(2, "ema", starts=(0, 4))


def test_the_ledger_keeps_pinned_frames_of_later_segments_and_plans_them_in_frame_order():
    book = segment_ledger()
    # frames 1..5 and 7..8 left the window; frame 6 (a segment's first frame) is kept like frame 0
    assert book.prefix_frames("pos", 14, 2) == [0, 6, 11, 12, 13]
    assert book.begin_call("pos", 14, 2) == Eviction(9, 11, None)
    assert book.held_frames("pos") == 5
    assert book.held_slots("pos") == [(0, 1), (6, 7), (11, 14)]
    # an eviction frees only unpinned frames; a store keeps its pinned frames and the frames the window shows
    assert book.evicted_slot_ranges(0, 11) == [(1, 6), (7, 11)]
    assert book.kept_ranges(0, 14) == [(0, 1), (6, 7), (9, 14)]
    plan = book.key_plan("pos", 14, (1, 1))
    assert plan.frames == (0, 6, 11, 12, 13, 14, 15) and plan.pinned == (True, True, *[False] * 5)


def test_positions_and_masks_follow_the_rule():
    book = segment_ledger()
    book.begin_call("pos", 14, 2)
    # "anchor": the pinned frames sit right before the oldest unpinned frame attended, in order
    assert book.key_positions("pos", 14, 2, 2).keys == (9, 10, 11, 12, 13, 14, 15)
    assert anchor_positions([0, 6, 11, 12], SegmentSinkRule(1, starts=(0, 6)), 0) == [9, 10, 11, 12]
    assert anchor_positions([0, 6, 11, 12], AttentionWindow(6, 1), 0) == [5, 6, 11, 12]  # the prefix rule
    # the mask of a two-chunk call (under 4 recent frames): every query sees both pinned frames, the recent slide
    window = AttentionWindow(5, 1)
    mask = build_sdpa_mask(window, 14, (1, 1), 1, "cpu", keys=book.key_plan("pos", 14, (1, 1)))[0, 0]
    expected = torch.tensor([[1, 1, 1, 1, 1, 1, 0], [1, 1, 0, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)


def test_a_ring_of_fixed_slots_refuses_a_rule_pinning_later_frames():
    with pytest.raises(ValueError, match="fixed slots"):
        Ledger(
            AttentionWindow(6, 1), SegmentSinkRule(1, starts=(0, 6)), ROPE_POSITION_MODES["absolute"], "absolute", True
        )


def test_the_ledger_edits_follow_a_segment_rule_or_refuse_it_before_any_change():
    book = segment_ledger()
    state = book.state("pos")
    # a store keeps the start of a chunk holding a later segment's pinned frame (6), so a rewind may go back there
    assert state.chunk_starts == [0, 2, 6, 8, 10, 12]
    # a truncation inside the chunk [6, 8) would keep frame 6, whose K/V saw frame 7: refused, nothing changed
    with pytest.raises(ValueError, match="chunk start"):
        book.truncate("pos", 7)
    assert (state.num_frames, state.evicted_before) == (14, 9)
    assert book.truncate("pos", 6) == (6, 14) and book.held_slots("pos") == [(0, 1)]
    # a windowed recache and a call under its own window keep the first frames as the sink: refused
    book = segment_ledger()
    with pytest.raises(ValueError, match="skip_evicted"):
        book.skip_evicted("pos", 16)
    assert (book.state("pos").num_frames, book.state("pos").recaching) == (14, False)
    with pytest.raises(ValueError, match="attention_window"):
        book.prefix_frames("pos", 14, 2, AttentionWindow(4, 1))
    # the prefix rule: a call's own window reads under its sink, a truncation may fall past the first chunk
    prefix = Ledger(AttentionWindow(6, 1), SinkRule(1), ROPE_POSITION_MODES["anchor"], "anchor", fixed_slots=False)
    prefix.tags.create("pos", **LAYOUT)
    for start in range(0, 14, 2):
        prefix.begin_call("pos", start, 2)
        prefix.store_window("pos", start, start + 2)
        prefix.commit_store("pos", start, 2)
    assert prefix.prefix_frames("pos", 14, 2, AttentionWindow(4, 1)) == [0, 13]
    assert prefix.truncate("pos", 7) == (7, 14)


def test_a_kv_flush_keeps_every_pinned_frame_of_a_segment_rule():
    book = segment_ledger()
    dropped = book.flush("pos", 2)
    # the unpinned frames before the last two drop; frame 6 (a later segment's first frame) stays with frame 0
    assert dropped == (1, 12) and book.evicted_slot_ranges(*dropped) == [(1, 6), (7, 12)]
    assert book.held_slots("pos") == [(0, 1), (6, 7), (12, 14)] and book.held_frames("pos") == 4
    # the first segment starts at frame 0: the window keeps the first frames visible as its sink
    with pytest.raises(ValueError, match="frame 0"):
        SegmentSinkRule(1, starts=(3, 8))


def test_a_recache_refuses_a_segment_rule_before_any_change():
    book = segment_ledger()
    engine = SimpleNamespace(ledger=book, tag_state=book.state)
    session = SimpleNamespace(
        transformer=SimpleNamespace(kv_cache_engines={"self": engine}),
        cache_tags=["pos"],
        chunks=[object()],
        prompt_embeds="old",
    )
    with pytest.raises(ValueError, match="A recache keeping the sink"):
        recache_keeping_sink(session, None, "pos")
    with pytest.raises(ValueError, match="A recache treats"):
        RolloutSession.switch_prompt(session, "new", recache=True)
    assert session.prompt_embeds == "old" and book.state("pos").num_frames == 14


def test_the_mask_memo_tells_apart_plans_differing_only_in_a_pinned_frame_of_the_call():
    # a segment rule may pin a frame of the call itself (here frame 6): its later chunk still sees it past the room
    window = AttentionWindow(3, 1)
    frames = (0, 4, 5, 6, 7, 8, 9)
    own_pin = KeyPlan(6, frames, (True, False, False, True, False, False, False))
    no_pin = KeyPlan(6, frames, (True, False, False, False, False, False, False))
    assert own_pin.pattern() == no_pin.pattern() and own_pin.prefix_pinned == no_pin.prefix_pinned
    memo = BlockMaskMemo()
    for keys in (own_pin, no_pin, own_pin):
        mask = memo.get("sdpa", window, 6, (2, 2), 1, "cpu", keys)
        assert torch.equal(mask, build_sdpa_mask(window, 6, (2, 2), 1, "cpu", keys))
    assert len(memo) == 2


def test_the_mask_memo_keeps_the_most_recently_used_masks():
    memo = BlockMaskMemo()
    for start in range(memo.max_masks + 3):
        memo.get("sdpa", AttentionWindow(), start, (1, 1), 1, "cpu")
    assert len(memo) == memo.max_masks
