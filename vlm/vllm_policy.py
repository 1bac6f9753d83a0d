"""`VLLMRolloutPolicy`: a `VLMPolicy` that samples through a colocated vLLM engine.

Training (``evaluate``) and greedy evaluation stay on the Hugging Face model; rollouts go to the
engine (``vlm/vllm_rollout.py``), as single completions, multi-turn episodes
(``vlm/vllm_episode.py``) or trees (``vlm/vllm_tree.py``). This module sits above the three.
"""

from __future__ import annotations

from torch import nn

from .policy import VLMPolicy
from .prompts import EncodedPrompt
from .rollout import SamplingParams
from .vllm_episode import sample_episodes
from .vllm_rollout import VLLMEngine
from .vllm_tree import sample_tree


class VLLMRolloutPolicy(VLMPolicy):
    """A ``VLMPolicy`` whose ``sample`` goes through a colocated ``VLLMEngine``: before each
    rollout the engine wakes up and receives the current weights, after it the engine sleeps.
    With ``episode`` settings the rollouts are multi-turn episodes (``vlm/vllm_episode.py``),
    with a ``tree`` of ``n`` leaves they are trees (``vlm/vllm_tree.py``).
    ``evaluate`` (training) and greedy evaluation stay on the HF model."""

    def __init__(self, model: nn.Module, processor, prompt, sampling, engine: VLLMEngine, **kwargs):
        super().__init__(model, processor, prompt, sampling, **kwargs)
        self.engine = engine
        self.sync_stats: dict[str, float] = {}

    @classmethod
    def colocate(cls, policy: VLMPolicy, engine: VLLMEngine) -> VLLMRolloutPolicy:
        """Wrap an existing policy (same model, processor and prompt settings)."""
        return cls(
            policy.model, policy.processor, policy.prompt, policy.sampling, engine,
            share_prefix=policy.share_prefix, episode=policy.episode, tree=policy.tree,
        )  # fmt: skip

    def sample(self, prompts: list[EncodedPrompt], n: int, sampling: SamplingParams | None = None):
        sampling = sampling or self.sampling
        self.engine.wake_up(["weights"])
        self.sync_stats = self.engine.sync_weights(self.model)
        self.engine.wake_up(["kv_cache"])
        shape = self.tree if self.tree is not None and self.tree.leaves == n else None
        try:
            if self.episode is not None:
                if shape is not None and len(shape.branches) > 1:
                    raise ValueError("trees of multi-turn episodes run on the HF engine only")
                return sample_episodes(self.engine, prompts, n, sampling, self.episode)
            if shape is not None and len(shape.branches) > 1:
                return sample_tree(self.engine, prompts, shape, sampling)
            return self.engine.sample(prompts, n, sampling)
        finally:
            self.engine.sleep()
