"""RoPE tables offset by an absolute start frame, built in float64 and kept out of reach of ``.to(dtype)`` casts."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch


class CausalRotaryTables:
    """Rotary tables of a Wan transformer for calls that start at any latent frame.

    The same axis split as diffusers' ``WanRotaryPosEmbed`` (``t = D - 2*h``, ``h = w = 2*(D//6)``) and the same
    frequencies; the tables are float64 tensors held outside the module's buffers (so ``from_pretrained`` and
    ``.to(torch.bfloat16)`` cannot round them) and moved to each device once.

    Temporal positions index the table directly; a call that would run past it raises (never a silent index past
    the end). RoPE re-basing (``enable_rope_rebasing()`` on the causal models) keeps a stream going by shifting
    positions back and re-rotating the cached keys with :meth:`temporal_shift`.
    """

    def __init__(self, attention_head_dim: int, patch_size: tuple[int, int, int], max_seq_len: int, theta=10000.0):
        self.patch_size = tuple(patch_size)
        self.max_seq_len = max_seq_len
        self.theta = theta
        h_dim = w_dim = 2 * (attention_head_dim // 6)
        t_dim = attention_head_dim - h_dim - w_dim
        self.split = (t_dim, h_dim, w_dim)
        # diffusers' ``get_1d_rotary_pos_embed`` rounds its tables to float32; these stay float64 end to end.
        angles = [self._angles(dim, max_seq_len, theta) for dim in self.split]  # per axis: (max_seq_len, dim / 2)
        self._cos = [a.cos().repeat_interleave(2, dim=1) for a in angles]  # per axis: (max_seq_len, axis_dim)
        self._sin = [a.sin().repeat_interleave(2, dim=1) for a in angles]
        self._per_device: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self._last_grid: tuple[tuple, torch.Tensor] | None = None
        self._position_grids: OrderedDict[tuple, torch.Tensor] = OrderedDict()

    @staticmethod
    def _inverse_frequencies(dim: int, theta: float) -> torch.Tensor:
        """``(dim / 2,)`` float64 ``1 / theta**(2i / dim)`` of one axis (the Wan/diffusers frequencies)."""
        return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)

    @classmethod
    def _angles(cls, dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
        """``(max_seq_len, dim / 2)`` float64 rotation angles ``position * inv_freq`` of one axis."""
        return torch.outer(torch.arange(max_seq_len, dtype=torch.float64), cls._inverse_frequencies(dim, theta))

    def _tables(self, device: torch.device):
        device = torch.device(device)
        if device not in self._per_device:
            dtype = torch.float32 if device.type == "mps" else torch.float64
            self._per_device[device] = (
                [c.to(device, dtype) for c in self._cos],
                [s.to(device, dtype) for s in self._sin],
            )
        return self._per_device[device]

    def _check_grid(self, height: int, width: int) -> None:
        if max(height, width) > self.max_seq_len:
            raise ValueError(f"A latent grid of {height}x{width} tokens exceeds the RoPE table ({self.max_seq_len}).")

    def check_range(self, start_position: int, num_frames: int, height: int, width: int) -> None:
        """Raise ``ValueError`` if temporal positions ``[start_position, start_position + num_frames)`` or the
        ``height x width`` grid fall outside the table (never index past it silently)."""
        if start_position < 0 or start_position + num_frames > self.max_seq_len:
            raise ValueError(
                f"Temporal RoPE positions [{start_position}, {start_position + num_frames}) fall outside the RoPE "
                f"table of {self.max_seq_len} positions (`rope_max_seq_len`); positions are latent frames, minus the "
                "offset of any earlier re-basing. Call `transformer.enable_rope_rebasing()` to shift the cached "
                "positions back and keep generating (see its docstring for the trade-off), or keep videos within "
                f"{self.max_seq_len} latent frames."
            )
        self._check_grid(height, width)

    def check_positions(self, positions: Sequence[int], height: int, width: int) -> None:
        """Raise ``ValueError`` if any temporal position of ``positions`` or the grid falls outside the table."""
        low, high = min(positions), max(positions)
        if low < 0 or high >= self.max_seq_len:
            raise ValueError(
                f"Temporal RoPE positions [{low}, {high}] fall outside the RoPE table of {self.max_seq_len} positions "
                "(`rope_max_seq_len`)."
            )
        self._check_grid(height, width)

    def at_positions(self, positions: Sequence[int], height: int, width: int, device: torch.device) -> torch.Tensor:
        """Rotations ``(1, len(positions)*H*W, 1, D/2)`` complex64 of frames at arbitrary temporal ``positions``.

        One frame per entry of ``positions``, in that order (the keys an engine returns, whose positions need not be
        ascending or distinct); each frame's ``H x W`` tokens get its temporal position and their row and column.
        ``self(start, F, ...)`` equals ``self.at_positions(range(start, start + F), ...)``. The last few grids are
        memoised (every step of a chunk asks for the same).
        """
        positions = tuple(int(p) for p in positions)
        self.check_positions(positions, height, width)
        key = (positions, height, width, torch.device(device))
        cached = self._position_grids.get(key)
        if cached is not None:
            self._position_grids.move_to_end(key)
            return cached
        index = torch.tensor(positions, device=self._tables(device)[0][0].device)
        rotations = self._grid(index, len(positions), height, width, device)
        self._position_grids[key] = rotations
        if len(self._position_grids) > 8:
            self._position_grids.popitem(last=False)
        return rotations

    def temporal_shift(self, shift: int, device: torch.device) -> torch.Tensor:
        """Rotation ``(1, 1, 1, D/2)`` complex64 by ``shift`` temporal positions (see :meth:`__call__`).

        Applied (``apply_rotary_emb``) to keys rotated for temporal position ``p``, it gives the keys rotated for
        ``p + shift``: RoPE rotations compose. The height and width channel pairs are left as they are.
        """
        t_dim, h_dim, w_dim = self.split
        angles = float(shift) * self._inverse_frequencies(t_dim, self.theta)  # (t_dim / 2,)
        identity = torch.ones((h_dim + w_dim) // 2, dtype=torch.complex64)
        rotation = torch.cat([torch.polar(torch.ones_like(angles), angles).to(torch.complex64), identity])
        return rotation.view(1, 1, 1, -1).to(device)

    def __call__(
        self, start_frame: int, num_frames: int, height: int, width: int, device: torch.device
    ) -> torch.Tensor:
        """Rotations ``(1, F*H*W, 1, D/2)`` complex64 for frames ``[start_frame, start_frame + F)``.

        ``height``/``width`` are post-patch token rows/columns. Channel pair ``(2i, 2i+1)`` of a head is rotated by
        element ``i`` (see :func:`fastgen_diffusers.processors.apply_rotary_emb`).
        """
        self.check_range(start_frame, num_frames, height, width)
        key = (start_frame, num_frames, height, width, torch.device(device))
        if self._last_grid is not None and self._last_grid[0] == key:  # every step of a chunk asks for the same grid
            return self._last_grid[1]
        rotations = self._grid(slice(start_frame, start_frame + num_frames), num_frames, height, width, device)
        self._last_grid = (key, rotations)
        return rotations

    def _grid(self, temporal, num_frames: int, height: int, width: int, device: torch.device) -> torch.Tensor:
        """Rotations ``(1, F*H*W, 1, D/2)`` complex64 of ``num_frames`` frames whose temporal table rows are
        ``temporal`` (a slice, or an index tensor on the tables' device), by rows ``[0, height)`` and columns
        ``[0, width)``."""
        cos, sin = self._tables(device)
        rows = (temporal, slice(0, height), slice(0, width))
        shapes = ((num_frames, 1, 1, -1), (1, height, 1, -1), (1, 1, width, -1))

        def grid(tables):  # the tables repeat each frequency twice (interleaved pairs): keep one of each pair
            parts = [t[r, ::2].view(s).expand(num_frames, height, width, -1) for t, r, s in zip(tables, rows, shapes)]
            return torch.cat(parts, dim=-1).reshape(1, num_frames * height * width, 1, -1)

        return torch.complex(grid(cos), grid(sin)).to(torch.complex64)
