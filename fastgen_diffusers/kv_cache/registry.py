"""Which attention modules an engine serves: ``id(module) -> block index`` for one branch of a model."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

OWNER_ATTRIBUTE = "_kv_cache_owner"  # set on each registered attention module: its registry's owner token


class OwnerToken:
    """The mark a registry leaves on the modules it registered (one object per registry, copied with the model)."""

    __slots__ = ()


class BlockRegistry:
    """The ``attn1``/``attn2`` modules of a branch's blocks; ``blocks[i]`` is block index ``i`` (local to the branch).

    Block indices are keyed by ``id(module)``. Ownership (:meth:`owns`) is the registry's :class:`OwnerToken`, set on
    each registered module: one object shared by every module of the branch, so that a compiled block that asks who
    owns its module guards on the branch's token, not on the module (one graph serves every block of a branch).

    A deep copy of a model copies its modules before its engines (``_modules`` comes first in its state), so a copied
    registry re-keys on the copied modules and shares their copied token: it resolves its own model's attention and
    not the original's. A copy of the registry alone keeps pointing at the same modules.
    """

    def __init__(self, blocks: Sequence[nn.Module] = ()) -> None:
        self._modules: list[tuple[nn.Module, ...]] = [(block.attn1, block.attn2) for block in blocks]
        self._index = self._build_index()
        self._token = OwnerToken()
        for modules in self._modules:
            for module in modules:
                setattr(module, OWNER_ATTRIBUTE, self._token)

    def _build_index(self) -> dict[int, int]:
        return {id(module): block_idx for block_idx, modules in enumerate(self._modules) for module in modules}

    def __len__(self) -> int:
        return len(self._modules)

    def owns(self, attn: nn.Module) -> bool:
        return getattr(attn, OWNER_ATTRIBUTE, None) is self._token

    @property
    def module_to_block(self) -> dict[int, int]:
        """``id(module) -> block index`` (the registry's own index: read it, do not change it)."""
        return self._index

    def block_index(self, attn: nn.Module, owner: str = "engine") -> int:
        """Branch-local block index of a registered attention module; ``RuntimeError`` for any other module."""
        try:
            return self._index[id(attn)]
        except KeyError:
            raise RuntimeError(
                f"{type(attn).__name__} at {id(attn):#x} is not registered with this {owner} "
                f"({len(self)} blocks registered)."
            ) from None

    def __deepcopy__(self, memo: dict) -> BlockRegistry:
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new._modules = [tuple(memo.get(id(module), module) for module in modules) for modules in self._modules]
        new._index = new._build_index()
        new._token = memo.get(id(self._token), self._token)  # the copied modules' token, if they were copied
        return new

    def __copy__(self) -> BlockRegistry:
        new = type(self).__new__(type(self))
        new._modules, new._index, new._token = list(self._modules), dict(self._index), self._token
        return new
