"""`TokenVLA`: a VLM that acts by generating action tokens (the OpenVLA recipe, in RL).

Each policy step the VLM is prompted with the camera image and the instruction and generates
exactly ``K * D`` tokens (K chunk steps of D action dims, step-major) under a logits mask that
allows only the ``bins`` action-token ids of an `ActionTokenizer`; they decode to bin centres in
[-1, 1]. The same mask is applied when the trainer re-scores the tokens through
``VLMPolicy.evaluate`` (the policy's ``banned_ids`` are every non-action id), so sampling and
training see one distribution.

Observations (``observe``) are per-env processed prompts: ``prompt_ids`` [L], per-token extras
[L], ``pixel_values`` [P, C] and ``image_grid_thw`` [1, 3] (lists with one tensor per env). In a
`RolloutBatch` they arrive as per-sample lists of [T_i, ...] stacks (one prompt per valid step);
``tokens`` holds the executed actions [B, T, K * D] (bin centres), re-encoded to ids here. A
step's log-prob is the sum over its ``K * D`` tokens. There is no value head: train it with a
group estimator (GRPO, RLOO ...), not GAE. One forward runs every valid step of a micro-batch's
rows (whole episodes for GRPO), so keep ``train.micro_batch_size`` small (episodes x steps
prompts go through the VLM together).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from ..trainer.batch import RolloutBatch
from ..trainer.policy import Evaluation
from ..vlm.policy import VLMPolicy
from ..vlm.prompts import PromptConfig, encode_prompts, vision_token_ids
from ..vlm.rollout import BANNED_LOGIT, collate, generation_mode
from . import hub
from .model_card import write_extras
from .tokenizer import ActionTokenizer

SPEC = hub.TOKEN_SPEC


@dataclass
class TokenSpec:
    """What a `TokenVLA` adds to its VLM directory (written to ``token_vla.json``)."""

    action_dim: int
    """env action dimensions D"""
    chunk: int = 1
    """K actions per policy step (K * D tokens generated)"""
    first_id: int = -1
    """vocabulary id of action bin 0 (-1: the last free block of ``bins`` ids, see action_block)"""
    bins: int = 256
    """bins per action dimension"""
    question: str = "What action should the robot take to {instruction}?"
    """user turn after the image; ``{instruction}`` is the task's instruction"""


def action_block(processor, vocab_size: int, bins: int = 256) -> ActionTokenizer:
    """The last ``bins`` consecutive ids below ``vocab_size`` that hold no special, added or
    vision token (OpenVLA overwrites the last ids; a special token there would be emitted as an
    action, and a vision placeholder would break the forward)."""
    tok = processor.tokenizer
    reserved = set(tok.all_special_ids) | set(vision_token_ids(processor))
    reserved |= {int(i) for i in getattr(tok, "added_tokens_decoder", {})}
    end = vocab_size
    while end - bins >= 0:
        clash = [i for i in reserved if end - bins <= i < end]
        if not clash:
            return ActionTokenizer(first_id=end - bins, bins=bins)
        end = min(clash)
    raise ValueError(
        f"a vocabulary of {vocab_size} ids has no {bins} consecutive free ids for action tokens; "
        "use fewer bins or a model with a larger vocabulary"
    )


class TokenVLA:
    """A `VLMPolicy` that emits ``K * D`` action tokens per step; implements `Policy` and
    ``observe``/``act`` for the VLA collectors. See the module docstring."""

    def __init__(self, vlm: VLMPolicy, spec: TokenSpec):
        self.vlm = vlm
        vocab = int(vlm.model.get_output_embeddings().weight.shape[0])
        if spec.first_id < 0:
            spec.first_id = action_block(vlm.processor, vocab, spec.bins).first_id
        self.spec = spec
        self.tokenizer = ActionTokenizer(first_id=spec.first_id, bins=spec.bins)
        if self.tokenizer.first_id + spec.bins > vocab:
            raise ValueError(
                f"action ids {spec.first_id}..{spec.first_id + spec.bins - 1} exceed the model's "
                f"vocabulary of {vocab}; rebuild the TokenSpec for this model"
            )
        allowed = torch.zeros(vocab, dtype=torch.bool)
        allowed[list(self.tokenizer.ids)] = True
        vlm.banned_ids = torch.nonzero(~allowed).flatten().tolist()  # evaluate masks these
        self._banned = torch.zeros(vocab, dtype=torch.bool)
        self._banned[vlm.banned_ids] = True

    @classmethod
    def from_pretrained(
        cls, path: str | Path, spec: TokenSpec | None = None, **load_kwargs
    ) -> TokenVLA:
        """A local image-text-to-text model directory; its ``token_vla.json`` (written by
        ``save``, checked by `hub.read_manifest` and `hub.read_origin`) gives the spec, else
        ``spec`` must (a VLM to start from). ``load_kwargs`` go to ``load_vlm`` (dtype, device,
        gradient_checkpointing, min_pixels ...)."""
        path = Path(path)
        saved = (path / SPEC).exists()
        if saved:
            hub.read_manifest(path)
            raw = json.loads((path / SPEC).read_text())
            spec = TokenSpec(**{k: v for k, v in raw.items() if k not in ("model_type", "version")})
        if spec is None:
            raise ValueError(f"{path} has no {SPEC}; pass a TokenSpec (action_dim, chunk)")
        prompt = PromptConfig(system_prompt=None, max_prompt_length=0)
        policy = cls(VLMPolicy.from_pretrained(path, prompt=prompt, **load_kwargs), spec)
        if saved:
            policy.origin = hub.read_origin(path, policy.describe)
        return policy

    @property
    def device(self) -> torch.device:
        return self.vlm.device

    @property
    def tokens_per_step(self) -> int:
        return self.spec.chunk * self.spec.action_dim

    # ------------------------------------------------------------------ observations
    def observe(self, batch) -> dict[str, list[Tensor]]:
        """A ``sim.vector.Batch`` (N envs) -> per-env prompt inputs (lists of N tensors). Every
        camera's image goes into the prompt, in ``env.cameras`` order (one agent view leaves a
        target's depth ambiguous; a wrist view resolves it, as for the compact VLA)."""
        if not batch.images:
            raise ValueError("TokenVLA needs camera images; make the env with env.obs_mode=rgb")
        # each (N, H, W, 3) uint8; the warp backend's are device tensors
        cams = [np.asarray(c.cpu()) if isinstance(c, Tensor) else c for c in batch.images.values()]
        samples = [
            {"id": i, "images": [Image.fromarray(c[i]) for c in cams],
             "question": self.spec.question.format(instruction=text)}
            for i, text in enumerate(batch.instructions)
        ]  # fmt: skip
        prompts, _ = encode_prompts(self.vlm.processor, samples, self.vlm.prompt, strict=True)
        obs: dict[str, list[Tensor]] = {"prompt_ids": [p.input_ids for p in prompts]}
        for key in sorted({k for p in prompts for k in (*p.token_extras, *p.vision)}):
            obs[key] = [p.token_extras.get(key, p.vision.get(key)) for p in prompts]
        return obs

    # ------------------------------------------------------------------ acting
    @torch.no_grad()
    def act(
        self, obs: dict[str, list[Tensor]], deterministic: bool = False
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Prompts of N envs -> (actions [N, K*D] bin centres, logp [N], value zeros [N])."""
        from transformers import GenerationConfig

        model, n_new = self.vlm.model, self.tokens_per_step
        kwargs = collate(obs, self.vlm.pad_id, self.device)
        P = kwargs["input_ids"].shape[1]
        gen = GenerationConfig(
            do_sample=not deterministic, temperature=1.0, top_p=1.0, top_k=0,
            max_new_tokens=n_new, min_new_tokens=n_new, pad_token_id=self.vlm.pad_id,
            eos_token_id=None, suppress_tokens=self.vlm.banned_ids, num_beams=1,
            repetition_penalty=1.0, use_cache=True, return_dict_in_generate=True,
            output_logits=True,
        )  # fmt: skip
        with generation_mode(model):  # eval, no grad, no checkpoint generation defaults
            out = model.generate(**kwargs, generation_config=gen)
        ids = out.sequences[:, P : P + n_new]  # (N, K*D)
        logits = self._masked(torch.stack(out.logits, dim=1).float())  # (N, K*D, V)
        logp = logits.log_softmax(-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1).sum(-1)
        actions = self.tokenizer.decode(ids.cpu(), self.spec.action_dim).flatten(1)  # (N, K*D)
        return actions, logp.cpu(), torch.zeros(len(ids))

    def _masked(self, logits: Tensor) -> Tensor:
        return logits.masked_fill(self._banned.to(logits.device), BANNED_LOGIT)

    # ------------------------------------------------------------------ policy protocol
    has_critic = False

    def evaluate(self, batch: RolloutBatch) -> Evaluation:
        """Re-score the executed actions' tokens under the action mask: logp and entropy [B, T]
        (sums over each step's K*D tokens; 0 on padding) and no value."""
        mask = batch.mask > 0  # (B, T)
        ev = self.vlm.evaluate(self.flat_batch(batch))  # (N, K*D) each, non-action ids banned
        out = []
        for x in (ev.logp.sum(-1), ev.entropy.sum(-1)):
            full = x.new_zeros(mask.shape)
            full[mask.to(x.device)] = x
            out.append(full)
        return Evaluation(out[0], out[1])

    def flat_batch(self, batch: RolloutBatch) -> RolloutBatch:
        """One row per valid policy step: its prompt (each step's own) and its K*D action-token
        ids."""
        mask = batch.mask > 0
        lens = mask.sum(1).tolist()
        inputs: dict[str, list] = {}
        for key, rows in batch.inputs.items():
            got = [int(x.shape[0]) for x in rows]
            if got != lens:
                raise ValueError(
                    f"inputs[{key!r}] step counts {got[:8]} do not match the mask's valid steps "
                    f"{lens[:8]}; masks must be right-padded with one prompt per valid step"
                )
            inputs[key] = [step for x in rows for step in x.unbind(0)]
        K, D = self.spec.chunk, self.spec.action_dim
        actions = batch.tokens[mask].float().reshape(-1, K, D)  # (N, K, D)
        ids = self.tokenizer.encode(actions).to(self.device)  # (N, K*D)
        return RolloutBatch(
            tokens=ids, mask=torch.ones(ids.shape, device=ids.device),
            group_id=torch.arange(len(ids)), prompts=inputs, prompt_index=torch.arange(len(ids)),
        )  # fmt: skip

    def parameters(self):
        return self.vlm.parameters()

    def state_dict(self) -> dict:
        return self.vlm.state_dict()

    def load_state_dict(self, state: dict, strict: bool = True):
        return self.vlm.load_state_dict(state, strict=strict)

    def train(self, mode: bool = True) -> TokenVLA:
        self.vlm.train(mode)
        return self

    origin: hub.Origin | None = None
    """the env and run it was trained on, which `save` records (set by the VLA builder, or read
    back by `from_pretrained`)"""

    def save(self, path: str | Path) -> None:
        """The VLM's HF directory plus ``token_vla.json`` (model_type, format version and the
        `TokenSpec`), ``policy_spec.json`` and the model card (`vla.hub`)."""
        self.vlm.save(path)
        manifest = hub.Manifest(hub.TOKEN_TYPE, hub.FORMAT_VERSION)
        raw = {"model_type": manifest.model_type, "version": manifest.version, **asdict(self.spec)}
        (Path(path) / SPEC).write_text(json.dumps(raw, indent=1))
        write_extras(path, self.describe(), manifest, self.origin)

    def describe(self, origin: hub.Origin | None = None) -> dict:
        """What the policy reads and emits (``policy_spec.json``'s features, action bins and
        prompt), on the env of ``origin`` (default: its own)."""
        return hub.token_description(self.spec, origin or self.origin)

    def load(self, path: str | Path) -> None:
        """Restore in place the weights ``save(path)`` wrote."""
        self.vlm.load(path)
