"""One rollout at a time per transformer, and kept rollouts that survive a failed continuation.

A causal pipeline keeps its KV caches in its transformer's engines, so two rollouts on one transformer (a call while a
``stream()`` of the same pipeline is open, two threads on one pipeline, two pipelines sharing a transformer through
``from_pipe``) would overwrite each other's caches. [`exclusive_rollout`] marks the pipeline entry points that use the
caches: a second entry while one is running is refused at once with a ``RuntimeError`` that names what holds the
caches. Nothing is serialized behind a lock: a stream may stay open for as long as its consumer likes, so waiting for
it could wait for ever. The rule for users: one pipeline per thread, and close (or finish) a stream before calling
its pipeline again.

[`BranchCheckpoint`] makes a continuation of a kept rollout (``continue_rollout``, ``redo_last_chunk``) a transaction:
if it fails or is interrupted, the branch is put back exactly as it was, so a retry works.
"""

from __future__ import annotations

import functools
import inspect
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

_HOLDERS_LOCK = threading.Lock()
# transformer -> what runs on its caches now; weak keys: a deleted model takes its entry with it, and `copy.deepcopy`
# of a model (EMA copies) does not copy a busy state.
_HOLDERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# The entries that are generators: they hold the caches between chunks, while their consumer runs.
GENERATOR_ENTRIES = ("stream()", "rollout()")


@dataclass(frozen=True)
class _Holder:
    entry: str  # "pipe(...)", "stream()", "continue_rollout()", ...
    pipeline: str  # class name of the pipeline that holds the caches
    thread_id: int
    thread_name: str


def _busy_message(holder: _Holder, entry: str) -> str:
    if holder.thread_id == threading.get_ident():
        if holder.entry in GENERATOR_ENTRIES:
            return (
                f"`{entry}` was called while a `{holder.entry}` of this {holder.pipeline} (or of a pipeline sharing "
                "its transformer) is open: they share the KV caches. Finish the generator or close it "
                "(`.close()`, or leave its `for` loop) first."
            )
        return (
            f"`{entry}` was called from inside a running `{holder.entry}` of this {holder.pipeline} (e.g. from a "
            "callback): they share the KV caches; a pipeline runs one rollout at a time."
        )
    return (
        f"`{entry}` was called while `{holder.entry}` of this {holder.pipeline} runs in thread "
        f"{holder.thread_name!r}: one pipeline per thread. The KV caches live in the transformer, so concurrent "
        "rollouts need one pipeline (and one transformer) per thread."
    )


def _acquire(transformer: Any, holder: _Holder) -> None:
    with _HOLDERS_LOCK:
        current = _HOLDERS.get(transformer)
        if current is not None:
            raise RuntimeError(_busy_message(current, holder.entry))
        _HOLDERS[transformer] = holder


def _release(transformer: Any, holder: _Holder) -> None:
    with _HOLDERS_LOCK:
        if _HOLDERS.get(transformer) is holder:
            del _HOLDERS[transformer]


def _holder(pipe: Any, entry: str) -> _Holder:
    thread = threading.current_thread()
    return _Holder(entry, type(pipe).__name__, thread.ident, thread.name)


def exclusive_rollout(entry: str) -> Callable[[Callable], Callable]:
    """Decorate a pipeline method that uses the KV caches: while it runs (for a generator: from its first ``next`` to
    its end or ``close``) no other decorated method of a pipeline on the same transformer may start; one that tries
    gets a ``RuntimeError`` naming ``entry`` of the holder. A pipeline without a transformer is not guarded."""

    def decorate(method: Callable) -> Callable:
        if inspect.isgeneratorfunction(method):

            @functools.wraps(method)
            def generator(self, *args, **kwargs) -> Iterator:
                transformer = getattr(self, "transformer", None)
                if transformer is None:
                    return (yield from method(self, *args, **kwargs))
                holder = _holder(self, entry)
                _acquire(transformer, holder)
                try:
                    return (yield from method(self, *args, **kwargs))
                finally:
                    _release(transformer, holder)

            return generator

        @functools.wraps(method)
        def call(self, *args, **kwargs):
            transformer = getattr(self, "transformer", None)
            if transformer is None:
                return method(self, *args, **kwargs)
            holder = _holder(self, entry)
            _acquire(transformer, holder)
            try:
                return method(self, *args, **kwargs)
            finally:
                _release(transformer, holder)

        return call

    return decorate


def warn_discarding_kept_rollouts(pipe: Any) -> None:
    """Warn (once per call: the kept rollouts are gone afterwards) that a new rollout frees the kept rollouts."""
    kept = pipe.rollout_branches
    if kept:
        warnings.warn(
            f"This call starts a new video and discards the kept rollouts {sorted(kept)} (from `keep_cache=True`). "
            "Continue them with `continue_rollout`, or free them with `pipe.discard_rollout()` before a new call to "
            "silence this warning.",
            UserWarning,
            stacklevel=_user_stacklevel(),
        )


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the caller's first frame outside this package and torch's decorators, so that a warning
    points at the user's call (and Python shows it once per call site)."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in ("fastgen_diffusers", "torch"):
        frame, level = frame.f_back, level + 1
    return level


class BranchCheckpoint:
    """The state of a kept rollout branch before a continuation, restored exactly if the continuation does not finish.

    The branch's [`RolloutSession`] is put back as it was (its chunks, prompts, frame count); its caches are restored
    one of two ways, chosen when the checkpoint is taken:

    * cheap: a continuation that only appends frames is undone by truncating the branch's caches back to its last
      frame; the cross K/V (rebuilt from the kept embeddings) are invalidated.
    * snapshot: a copy of the branch's caches under backup tags, for continuations that rewrite the prefix
      (``rewrites_prefix``: a ``recache`` prompt switch, ``redo_last_chunk``) or may evict from it (any engine with
      a sliding window, which RoPE re-basing needs too). The vanilla engine shares the stored tensors, the static one
      copies its buffers (memory of one more copy of the branch's caches while the continuation runs).

    A conditioner grown by the continuation (``Conditioner.extend``) stays grown: its earlier frames do not change.
    """

    BACKUP_PREFIX = "__checkpoint__/"

    def __init__(self, pipe: Any, branch: str, rewrites_prefix: bool) -> None:
        self.pipe = pipe
        self.branch = branch
        self.session = pipe.kept_rollout(branch)
        self.state = dict(vars(self.session), chunks=list(self.session.chunks))
        self.engines = dict(pipe.transformer.kv_cache_engines)
        evicts = any(engine.window_frames is not None for engine in self.engines.values())
        self.snapshot = rewrites_prefix or evicts
        self.backups: dict[str, str] = {}
        self.committed = False
        if self.snapshot:
            for tag in self.session.cache_tags:
                backup = self.BACKUP_PREFIX + tag
                for engine in self.engines.values():
                    if engine.tag_state(tag) is not None:
                        engine.copy_tag(tag, backup)
                        self.backups[tag] = backup

    def restore(self) -> None:
        """Put the branch's caches and its session back as they were when the checkpoint was taken."""
        num_frames = self.state["num_latent_frames"]
        for engine in self.engines.values():
            for tag in self.session.cache_tags:
                if self.snapshot:
                    engine.clear(tag)
                    if tag in self.backups and engine.tag_state(self.backups[tag]) is not None:
                        engine.copy_tag(self.backups[tag], tag)
                elif engine.tag_state(tag) is not None:
                    engine.truncate(tag, num_frames)
                    engine.invalidate_cross(tag)
        vars(self.session).update(self.state, chunks=list(self.state["chunks"]))
        self.pipe._sessions[self.branch] = self.session

    def release(self) -> None:
        """Free the backup copies."""
        for engine in self.engines.values():
            for backup in self.backups.values():
                engine.clear(backup)
        self.backups.clear()

    def commit_if(self, finished: bool) -> None:
        """Keep what the continuation did if it ``finished`` (an interrupted one returns without an error)."""
        self.committed = finished

    def __enter__(self) -> BranchCheckpoint:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        try:
            if exc_type is not None or not self.committed:
                self.restore()
        finally:
            self.release()
