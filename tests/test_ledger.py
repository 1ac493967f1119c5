"""The ledger alone: torch-free bookkeeping that plans each call (slots, frames read in order, positions, evictions,
the sink rule's fold) without a tensor."""

from __future__ import annotations

import ast
import pathlib

import pytest
from test_import_graph import PACKAGE, _module_name, import_graph

from fastgen_diffusers import StaticKVCacheEngine, VanillaKVCacheEngine
from fastgen_diffusers.kv_cache import AttentionWindow
from fastgen_diffusers.kv_cache.ledger import Eviction, Ledger, SinkRule
from fastgen_diffusers.kv_cache.positions import ROPE_POSITION_MODES

LAYOUT = dict(batch_size=1, frame_seqlen=2, num_heads=2, head_dim=4, dtype="float32", device="cpu")


def ledger(window=None, sink=0, update="fixed", positions="absolute", fixed_slots=True) -> Ledger:
    mode = ROPE_POSITION_MODES[positions]
    return Ledger(AttentionWindow(window, sink), SinkRule(sink, update), mode, positions, fixed_slots)


def store(book: Ledger, start: int, frames: int, tag: str = "pos") -> list[tuple[int, int]]:
    """What the engine asks the ledger around one store call of ``frames`` frames at ``start``."""
    if book.state(tag) is None:
        book.tags.create(tag, **LAYOUT)
    book.begin_call(tag, start, frames)
    kept = book.store_window(tag, start, start + frames)
    book.commit_store(tag, start, frames)
    return kept


def outside_imports(path: pathlib.Path) -> list[str]:
    """The absolute imports of ``path`` that run at import: module level, inside ``if``/``try``/``with`` too, but not
    under ``if TYPE_CHECKING:`` (annotations only)."""
    names, pending = [], list(ast.parse(path.read_text()).body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            pending.extend(node.orelse)
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            pending.extend(ast.iter_child_nodes(node))
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names.append(node.module or "")
    return names


@pytest.mark.parametrize("module", ["ledger", "tags", "positions", "window", "sink"])
def test_the_bookkeeping_imports_no_torch(module):
    """The module and every package module it imports, transitively (``test_import_graph.import_graph``: torch
    arriving through another module of the package counts), import no torch at import time."""
    graph = import_graph()
    paths = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    reached, pending = set(), [f"fastgen_diffusers.kv_cache.{module}"]
    while pending:
        name = pending.pop()
        if name not in reached:
            reached.add(name)
            pending.extend(graph[name])
    torch_importers = [
        name for name in sorted(reached) if "torch" in {n.split(".")[0] for n in outside_imports(paths[name])}
    ]
    assert not torch_importers, torch_importers


def test_slots_of_a_ring_and_of_a_list():
    ring, runs = ledger(window=5, sink=1), ledger(window=5, sink=1, fixed_slots=False)
    # the ring: the sink at its frame, later frames at 1 + (f - 1) % 4
    assert ring.slot_runs(0, 3) == [(0, 0, 3)]
    assert ring.slot_runs(5, 8) == [(5, 1, 3)]
    assert ring.slot_runs(3, 7) == [(3, 3, 2), (5, 1, 2)]  # wraps past the last slot
    assert ring.slot_frames(8) == (0, 5, 6, 7, 4)
    # a list of runs: the slot is the frame
    assert runs.slot_runs(5, 8) == [(5, 5, 3)]
    assert runs.slot_ranges([(0, 1), (5, 8)]) == [(0, 1), (5, 8)]


def test_a_call_plans_its_reads_in_order_and_its_evictions():
    book = ledger(window=5, sink=1)
    for start in (0, 2, 4):
        store(book, start, 2)
    # a call at 6 of 2 frames sees the sink and frames 4..5 (4 frames of room); frames 2..3 leave the window
    assert book.prefix_frames("pos", 6, 2) == [0, 4, 5]
    assert book.key_frames("pos", 6, 2, 2, in_place=False) == [0, 4, 5, 6, 7]
    assert book.key_frames("pos", 6, 2, 2, in_place=True) == [0, 5, 6, 7, 4]  # slot order: the ring has wrapped
    assert book.begin_call("pos", 6, 2) == Eviction(2, 4, None)
    assert book.state("pos").evicted_before == 4
    assert book.held_frames("pos") == 3  # the sink and frames 4..5
    assert book.reads_in_place("pos", 6, 2, 2) and not book.reads_in_place("pos", 4, 2, 2)


def test_the_sink_rule_decides_pinning_and_folding():
    fixed, ema = SinkRule(2), SinkRule(2, "ema", 0.9)
    assert fixed.pinned(1) and not fixed.pinned(2) and fixed.pinned_range(1) == (0, 1)
    assert fixed.fold(5, 7) is None
    assert ema.fold(5, 7) == ((0, 2), (5, 7))
    book = ledger(window=6, sink=2, update="ema", positions="window")
    for start in (0, 2, 4):
        store(book, start, 2)
    assert book.begin_call("pos", 6, 2) == Eviction(2, 4, ((0, 2), (2, 4)))


def test_positions_follow_the_mode_and_a_rope_cut():
    book = ledger(window=5, sink=1, positions="window")
    for start in (0, 2, 4):
        store(book, start, 2)
    positions = book.key_positions("pos", 6, 2, 2)
    assert positions.keys == (0, 1, 2, 3, 4) and positions.queries == (3, 4)
    book.set_rope_cut("pos", 40)
    assert book.key_positions("pos", 6, 2, 2).queries == (40, 41)
    with pytest.raises(ValueError, match="RoPE cut"):
        ledger(window=5, sink=1).set_rope_cut("pos", 3)


def test_edits_return_the_frames_they_drop():
    book = ledger(window=5, sink=1)
    for start in (0, 2, 4, 6):
        store(book, start, 2)
    assert book.truncate("pos", 6) == (6, 8)
    assert book.num_frames("pos") == 6
    with pytest.raises(ValueError, match="Cannot truncate cache_tag 'pos' at frame 5"):
        book.truncate("pos", 5)  # inside the held chunk [4, 6)
    assert book.flush("pos", 1) == (1, 5)
    assert book.state("pos").flushed_before == 5
    assert book.skip_evicted("pos", 9) == (1, 9) and book.state("pos").recaching
    assert book.truncate("pos", 3) == (3, 9)  # every frame past the sink's chunk is evicted: nothing held is cut
    with pytest.raises(ValueError, match="Cannot truncate cache_tag 'pos' at frame 1"):
        book.truncate("pos", 1)  # inside the sink's chunk [0, 2)


def test_a_call_the_ledger_refuses_is_refused_before_any_work():
    book = ledger(window=4, sink=0)
    store(book, 0, 2)
    with pytest.raises(ValueError, match="leaves a hole"):
        book.check_call("pos", 5, (1,), {**LAYOUT})
    with pytest.raises(ValueError, match="frame_seqlen"):
        book.check_call("pos", 2, (2,), {**LAYOUT, "frame_seqlen": 3})


@pytest.mark.parametrize("engine_class", [StaticKVCacheEngine, VanillaKVCacheEngine])
def test_the_engine_interface_is_a_dozen_methods_over_the_ledger(engine_class):
    """The engine's own interface (registration, one forward, edits); everything else is a thin view."""
    from fastgen_diffusers.kv_cache.base import BaseKVCacheEngine

    own = sorted(name for name in vars(BaseKVCacheEngine) if not name.startswith("_") and name != "storage_class")
    assert own == [
        "begin_call",
        "begin_transaction",
        "cache_view",
        "check_call",
        "clear",
        "copy_tag",
        "end_transaction",
        "ensure_capacity",
        "plan_call",
        "register_blocks",
        "rollback",
        "store",
        "truncate",
    ]
    engine = engine_class(window_frames=5, sink_frames=1)
    assert isinstance(engine.ledger, Ledger) and engine.ledger.sink == SinkRule(1)
    assert engine.ledger.window is engine.window
    assert not [name for name in vars(engine_class) if not name.startswith("_") and name != "storage_class"]
