"""A session's settings, as they arrive in JSON: the package's settings values, plus the few things of a session.

A start message's ``settings`` object holds:

* the rollout's settings, as the [`RolloutSettings`] value they are: its flat names (``num_inference_steps``,
  ``attention_window``, ``kv_cache_policy``, ``context_frames``, ...; :func:`argument_names`) and/or ``"rollout"``,
  the value's own JSON (``RolloutSettings.to_dict()``, with its version). They are checked by the value on
  construction, so a bad one is refused with the settings' own message;
* the session's frame and seed: ``height``, ``width``, ``seed``, ``negative_prompt``, ``strength`` (video input);
* how frames are delivered: ``encoding``, ``jpeg_quality``, ``slow_client``.

Nothing here can name a file, a model or a device. Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..settings import RolloutSettings, argument_names

# the session's own values: name -> (accepted JSON types, may be null)
SESSION_SETTINGS: dict[str, tuple[tuple[type, ...], bool]] = {
    "height": ((int,), False),
    "width": ((int,), False),
    "seed": ((int,), False),
    "negative_prompt": ((str,), True),
    "strength": ((int, float), False),  # video input only
}
ENCODINGS = ("jpeg", "raw")
SLOW_CLIENT_MODES = ("wait", "drop")
DELIVERY_SETTINGS = ("encoding", "jpeg_quality", "slow_client")
ROLLOUT_KEY = "rollout"
# a session cannot keep its rollout (it ends with the session)
REFUSED_ARGUMENTS = ("keep_cache",)


def rollout_argument_names() -> tuple[str, ...]:
    """The flat rollout settings a session may set."""
    return tuple(name for name in argument_names() if name not in REFUSED_ARGUMENTS)


@dataclass(frozen=True)
class SessionSettings:
    """A session's resolved settings.

    Args:
        rollout: the [`RolloutSettings`] of its rollout (the server's defaults under the client's values).
        session: ``height``, ``width``, ``seed`` and, where set, ``negative_prompt`` and ``strength``.
        encoding: of the frames sent: ``"jpeg"``, or ``"raw"`` (RGB bytes, row-major ``H x W x 3``).
        jpeg_quality: 1 to 100.
        slow_client: ``"wait"`` (the session pauses) or ``"drop"`` (its chunks are dropped) while a client lags.
    """

    rollout: RolloutSettings
    session: dict[str, Any]
    encoding: str = "jpeg"
    jpeg_quality: int = 80
    slow_client: str = "wait"

    @property
    def height(self) -> int:
        return self.session["height"]

    @property
    def width(self) -> int:
        return self.session["width"]

    @property
    def seed(self) -> int:
        return self.session["seed"]

    def call_kwargs(self) -> dict[str, Any]:
        """The pipeline call's keyword arguments (the seed excluded: it seeds the session's generator)."""
        session = {name: value for name, value in self.session.items() if name != "seed"}
        return {**session, "settings": self.rollout}

    def to_dict(self, rollout: RolloutSettings | None = None) -> dict[str, Any]:
        """The values as JSON (the ``started`` message's ``settings``), with ``rollout`` (the run's resolved settings)
        in place of the requested ones when given."""
        rollout = self.rollout if rollout is None else rollout
        return {**self.session, ROLLOUT_KEY: rollout.to_dict(), "encoding": self.encoding,
                "jpeg_quality": self.jpeg_quality, "slow_client": self.slow_client}  # fmt: skip


def _check_type(name: str, value: Any, types: tuple[type, ...], nullable: bool) -> None:
    if value is None and nullable:
        return
    if isinstance(value, bool) or not isinstance(value, types):
        kinds = " or ".join(t.__name__ for t in types) + (" or null" if nullable else "")
        raise ValueError(f"Setting {name!r} must be {kinds}, got {value!r}.")


def session_settings(
    settings: Any, session_defaults: dict[str, Any], rollout_defaults: RolloutSettings, video: bool
) -> SessionSettings:
    """Check a start message's ``settings`` object and resolve it over the server's defaults.

    Raises:
        ValueError: ``settings`` is not an object, names a setting that is none of the accepted ones, has a session
            value of the wrong JSON type or a video-only one in text mode, or a rollout setting the settings values
            refuse (their own message).
    """
    if settings is None:
        settings = {}
    if not isinstance(settings, dict):
        raise ValueError(f"`settings` must be a JSON object, got {type(settings).__name__}.")
    rollout_names = rollout_argument_names()
    accepted = (*SESSION_SETTINGS, *DELIVERY_SETTINGS, ROLLOUT_KEY, *rollout_names)
    unknown = sorted(set(settings) - set(accepted))
    if unknown:
        refused = [name for name in unknown if name in REFUSED_ARGUMENTS]
        if refused:
            raise ValueError(f"Settings {refused} do not apply to a session (its rollout ends with it).")
        raise ValueError(f"Unknown settings {unknown}; accepted: {list(accepted)}.")
    session = {name: value for name, value in session_defaults.items() if video or name != "strength"}
    for name, (types, nullable) in SESSION_SETTINGS.items():
        if name not in settings:
            continue
        if name == "strength" and not video:
            raise ValueError('Setting \'strength\' applies to video input only (`"input": "video"`).')
        _check_type(name, settings[name], types, nullable)
        session[name] = settings[name]
    rollout = rollout_defaults
    if settings.get(ROLLOUT_KEY) is not None:
        if not isinstance(settings[ROLLOUT_KEY], dict):
            raise ValueError(f"Setting {ROLLOUT_KEY!r} must be a RolloutSettings JSON object (`to_dict()`).")
        rollout = rollout.merge(RolloutSettings.from_dict(settings[ROLLOUT_KEY]))
    flat = {name: settings[name] for name in rollout_names if name in settings}
    if flat:
        rollout = rollout.merge(**flat)
    encoding = settings.get("encoding", "jpeg")
    if encoding not in ENCODINGS:
        raise ValueError(f"Setting 'encoding' must be one of {list(ENCODINGS)}, got {encoding!r}.")
    quality = settings.get("jpeg_quality", 80)
    _check_type("jpeg_quality", quality, (int,), False)
    if not 1 <= quality <= 100:
        raise ValueError(f"Setting 'jpeg_quality' must be in [1, 100], got {quality}.")
    slow = settings.get("slow_client", "wait")
    if slow not in SLOW_CLIENT_MODES:
        raise ValueError(f"Setting 'slow_client' must be one of {list(SLOW_CLIENT_MODES)}, got {slow!r}.")
    return SessionSettings(rollout, session, encoding, quality, slow)
