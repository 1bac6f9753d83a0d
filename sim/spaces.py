"""``InstructionText``: a gymnasium ``Text`` space that survives ``AsyncVectorEnv`` shared memory.

gymnasium 1.4 decodes a ``Text`` field of the shared observation buffer once, when the vector env
is built, and keeps that tuple: every later batch shows the stale (blank) strings. Registering a
reader for this subclass returns a live, read-only view that decodes the buffer on access; a
``deepcopy`` (what ``AsyncVectorEnv(copy=True)`` returns) freezes it into a plain tuple.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from gymnasium import spaces
from gymnasium.vector.utils import read_from_shared_memory


class InstructionText(spaces.Text):
    """``Text`` for instructions; identical to ``gymnasium.spaces.Text`` except in shared memory."""


class LiveTexts(Sequence):
    """N strings decoded on access from a shared int32 buffer [N, max_length]."""

    def __init__(self, space: InstructionText, buffer, n: int):
        self.space, self.buffer, self.n = space, buffer, n

    def _row(self, i: int) -> str:
        codes = np.frombuffer(self.buffer.get_obj(), dtype=np.int32)
        row = codes[i * self.space.max_length : (i + 1) * self.space.max_length]
        chars, size = self.space.character_list, len(self.space.character_list)
        return "".join(chars[v] for v in row if v < size)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(self._row(i) for i in range(self.n)[index])
        if not -self.n <= index < self.n:
            raise IndexError(f"instruction index {index} out of range for {self.n} envs")
        return self._row(index % self.n)

    def __len__(self) -> int:
        return self.n

    def __deepcopy__(self, memo) -> tuple[str, ...]:
        return tuple(self)

    def __copy__(self) -> tuple[str, ...]:
        return tuple(self)

    def __eq__(self, other) -> bool:
        return tuple(self) == tuple(other)

    def __repr__(self) -> str:
        return f"LiveTexts{tuple(self)!r}"


@read_from_shared_memory.register(InstructionText)
def _read_instructions(space: InstructionText, shared_memory, n: int = 1) -> LiveTexts:
    return LiveTexts(space, shared_memory, n)


__all__ = ["InstructionText", "LiveTexts"]
