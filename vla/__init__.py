"""VLA side: compact and token VLA policies, action tokenizer, env-rollout collectors,
behaviour cloning and held-out evaluation on the MuJoCo suite (``perceptrl.sim``)."""

from __future__ import annotations

from .compact import CompactSpec, CompactVLA
from .tokenizer import ActionTokenizer

__all__ = ["ActionTokenizer", "CompactSpec", "CompactVLA"]
