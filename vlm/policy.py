"""`VLMPolicy`: a Hugging Face image-text-to-text model behind the trainer's `Policy` protocol.

``evaluate`` re-scores sampled completions in one forward with the pixel values: each row is its
prompt left-padded to the minibatch's longest prompt, then its completion right-padded, so every
completion starts at the same column and only those ``T + 1`` positions go through the LM head
(``logits_to_keep``). Position ids (Qwen's 3-D M-RoPE included) come from the model itself, from
the attention mask, ``mm_token_type_ids`` and ``image_grid_thw``; padding does not change results.
The batch says which rows share a prompt (``prompts`` stored once, ``prompt_index`` per row), so
the vision tower runs once per prompt and the model gets the features per row
(``mm_encoder_outputs``, Qwen2/2.5-VL).

The segment walk (``share_prefix``, on by default, Qwen2/2.5-VL): when rows share a prompt, the
forward walks the batch's segment table instead (``batch.segments``, ``trainer/segments.py``), as
Prefix Grouper does for one level. The U distinct prompts go through the model once (left-padded,
vision included) and leave their per-layer keys/values; then each level's distinct segments run
once on their parents' keys/values: a tree's depths (`tree_levels`, read from the table), or one
level of whole rows (`row_level`: flat groups, episodes). The indexing of the parents' caches is
differentiable, so a shared segment's gradient is the sum over the rows below it. Same log-probs
and gradients as one forward over [B, P + T] (tested), with U * P + (distinct segment tokens)
instead of B * (P + T). Positions (3-D M-RoPE) are the model's own ``get_rope_index`` of the
prompts, continued by the segments.

Episodes (``policy.episode``, see ``vlm/episode.py``): a row's completion holds observation
tokens between the policy's turns (observation segments of ``batch.segments``), image
placeholders included. Both forwards attend to them (``segments.attention()``) while the loss
mask stays on the policy's tokens; each row's observation images follow its prompt's images in
the vision inputs, so every image lands at its place, and positions come from
``get_rope_index`` over the whole sequence. An observation is stored once however many rows
hold it (``segments.vision``); when rows share one (a tree of episodes) and the model takes
image features (Qwen2/2.5-VL), its image goes through the vision tower once.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from ..trainer.batch import RolloutBatch
from ..trainer.policy import Evaluation
from ..trainer.segments import OBSERVATION
from . import rollout
from .episode import EpisodeSettings
from .hf_engine import rope_module
from .model import check_model_dir, load_vlm
from .prompts import EncodedPrompt, PromptConfig, encode_prompts, vision_token_ids
from .rollout import BANNED_LOGIT, SamplingParams
from .schedule import TreeShape

OBS_PREFIX = "obs_"
"""``RolloutBatch.inputs`` keys of episode observations (see ``vlm/episode.py``)."""

SHARED_VISION_MODELS = ("qwen2_5_vl", "qwen2_vl")
"""Model types whose ``mm_encoder_outputs`` takes image features as ``pooler_output`` alone
(Qwen3-VL adds deepstack features, so it keeps the plain per-row path)."""
SHARED_PREFIX_MODELS = ("qwen2_5_vl", "qwen2_vl")
"""Model types whose shared-prefix forward is verified (their ``get_rope_index`` takes
``input_ids, mm_token_type_ids, image_grid_thw, attention_mask``); others keep one forward."""


def disable_dropout(model: nn.Module) -> None:
    """Zero every dropout probability: ``logp_old`` (no grad) and ``logp`` (with grad) must come
    from the same deterministic forward, or the PPO ratio is noise from the first minibatch."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        for attr in ("attention_dropout", "dropout", "hidden_dropout"):
            if isinstance(getattr(m, attr, None), float):
                setattr(m, attr, 0.0)


class VLMPolicy:
    """A VLM as an RL policy: ``encode`` for prompts, ``evaluate`` for the trainer. Rollouts are
    sampled by ``vlm/sampler.py`` (`Rollouts`) on an engine, with the settings kept here.

    Args:
        model: an ``AutoModelForImageTextToText`` model.
        processor: its ``AutoProcessor``.
        prompt: how samples become prompts (system prompt, max_prompt_length, pixel bounds).
        sampling: how the rollouts sample; ``evaluate`` scores the same tempered distribution,
            so this is the one place the rollout temperature is set.
        episode: multi-turn settings (budgets, the environment that answers a turn); None
            samples one completion per row.
        tree: how completions branch (``vlm/schedule.py``; for episodes a segment is a turn);
            None samples flat groups. Used when a call asks for ``tree.leaves`` completions
            per prompt.
    """

    def __init__(
        self,
        model: nn.Module,
        processor,
        prompt: PromptConfig | None = None,
        sampling: SamplingParams | None = None,
        *,
        share_prefix: bool = True,
        episode: EpisodeSettings | None = None,
        tree: TreeShape | None = None,
    ):
        self.model = model
        self.processor = processor
        self.prompt = prompt or PromptConfig()
        self.sampling = sampling or SamplingParams()
        """the rollouts' sampling settings (the rollout source samples with them)"""
        self.episode = episode
        """multi-turn rollouts (the rollout source and the evaluator read it); None: one turn"""
        self.tree = tree
        """tree shape (None: flat groups)"""
        self.stop_ids = rollout.stop_token_ids(model, processor)
        self.pad_id = rollout.pad_token_id(processor, self.stop_ids)
        self.banned_ids = vision_token_ids(processor)
        params = inspect.signature(model.forward).parameters
        self._keep_arg = "logits_to_keep" in params
        self._share_vision = (
            "mm_encoder_outputs" in params
            and getattr(model.config, "model_type", "") in SHARED_VISION_MODELS
        )
        self.share_prefix = share_prefix
        """training forward computes each distinct prompt once and its rows' completions attend
        to its keys/values (see the module docstring); False: one forward over prompt +
        completion per row"""
        self._rope = None  # the module with get_rope_index (the inner Qwen2/2.5-VL model)
        if getattr(model.config, "model_type", "") in SHARED_PREFIX_MODELS:
            self._rope = rope_module(model)
        disable_dropout(model)
        model.train()  # activation checkpointing only runs in train mode; dropout is off

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        *,
        prompt: PromptConfig | None = None,
        sampling: SamplingParams | None = None,
        share_prefix: bool = True,
        episode: EpisodeSettings | None = None,
        tree: TreeShape | None = None,
        **load_kwargs,
    ) -> VLMPolicy:
        """Load a local model directory (see ``load_vlm`` for ``load_kwargs``)."""
        prompt = prompt or PromptConfig()
        load_kwargs.setdefault("min_pixels", prompt.min_pixels)
        load_kwargs.setdefault("max_pixels", prompt.max_pixels)
        model, processor = load_vlm(path, **load_kwargs)
        return cls(
            model, processor, prompt, sampling, share_prefix=share_prefix, episode=episode,
            tree=tree,
        )  # fmt: skip

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def stop_text(self) -> str:
        """The token that ends a turn, as text (``<|im_end|>`` for Qwen)."""
        return self.processor.tokenizer.convert_ids_to_tokens(self.stop_ids[0])

    @property
    def temperature(self) -> float:
        """Temperature of the distribution ``evaluate`` scores: the rollouts' (1 for greedy
        rollouts), so PPO ratios compare like with like (as verl does)."""
        t = self.sampling.temperature
        return t if t > 0 else 1.0

    # ---- trainer protocol -------------------------------------------------------------------

    has_critic = False

    def evaluate(self, batch: RolloutBatch) -> Evaluation:
        """Per-token log-probs and entropies of the completions, with gradients.

        Returns:
            logp [B, T] float32 and entropy [B, T] float32 (0 where mask is 0); no value.
        """
        logits = self.completion_logits(batch)  # [B, T, V]
        logp_all = (logits.float() / self.temperature).log_softmax(-1)  # what the rollouts sample
        tokens = batch.tokens.to(logp_all.device)
        mask = batch.mask.to(logp_all.device, torch.float32)
        logp = logp_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # [B, T]
        entropy = -(logp_all.exp() * logp_all).sum(-1)  # [B, T]
        return Evaluation(logp * mask, entropy * mask)

    def completion_logits(self, batch: RolloutBatch) -> Tensor:
        """Logits that predict each completion token, [B, T, V] (vision placeholders banned)."""
        if batch.prompt_index is None:
            raise ValueError(
                "VLMPolicy.evaluate needs the batch's prompts (RolloutBatch.prompts and "
                "prompt_index, as rollout.sample fills them)"
            )
        if batch.num_prompts() < len(batch) and self._prefix_applies(batch):
            logits = self._level_logits(batch, tree_levels(batch) or [row_level(batch)])
        else:
            logits = self._full_logits(batch)
        if self.banned_ids:
            banned = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
            banned[self.banned_ids] = True
            logits = logits.masked_fill(banned, BANNED_LOGIT)
        return logits

    def _full_logits(self, batch: RolloutBatch) -> Tensor:
        """One forward over each row's prompt + completion. Returns [B, T, V]."""
        T = batch.tokens.shape[1]
        kwargs = self._sequence_kwargs(batch, self.device)
        if self._keep_arg:
            kwargs["logits_to_keep"] = T + 1
        if self._share_vision and batch.num_prompts() < len(batch):
            self._shared_image_features(batch, kwargs)
        out = self.model(**kwargs, use_cache=False)
        return out.logits[:, -(T + 1) : -1]  # [B, T, V]: position P-1+t predicts token t

    def _sequence_kwargs(self, batch: RolloutBatch, device, pixels: bool = True) -> dict:
        """Model inputs of whole rows [B, P + T]: prompts left-padded, completions right-padded
        and attended where they hold policy or observation tokens; a row's observation images
        follow its prompt's, and the observations' per-token inputs fill the completion part."""
        rows = batch.row_prompts()
        for k, per_row in _row_obs_vision(batch).items():
            if not pixels and k.startswith("pixel_values"):
                continue
            mine = rows.get(k, [None] * len(batch))
            rows[k] = [
                o if p is None else p if o is None else torch.cat([p, o.to(p.device)])
                for p, o in zip(mine, per_row)
            ]
        if not pixels:
            rows = {k: v for k, v in rows.items() if not k.startswith("pixel_values")}
        kwargs = rollout.collate(
            rows, self.pad_id, device, batch.tokens.to(device), completion_attention(batch)
        )
        T = batch.tokens.shape[1]
        for key, v in batch.inputs.items():
            k = key[len(OBS_PREFIX) :]
            if key.startswith(OBS_PREFIX) and isinstance(v, Tensor) and k != "mask":
                if k not in kwargs:
                    kwargs[k] = torch.zeros_like(kwargs["input_ids"], dtype=v.dtype)
                kwargs[k][:, -T:] = v.to(device)
        return kwargs

    def _prefix_applies(self, batch: RolloutBatch) -> bool:
        """Whether the shared-prefix forward may run: switched on, a verified model family, no
        videos (their positions depend on per-video timestamps), and neither activation
        checkpointing (it drops the cache) nor ZeRO-3 (ranks must run the same forwards)."""
        if not self.share_prefix or self._rope is None or len(batch) < 2:
            return False
        if any(v is not None for v in batch.prompts.get("pixel_values_videos", [])):
            return False
        if self.model.training and any(
            getattr(m, "gradient_checkpointing", False) is True for m in self.model.modules()
        ):
            return False
        return not hasattr(next(self.model.parameters()), "ds_id")  # ZeRO-3 partitioned

    def _level_logits(self, batch: RolloutBatch, levels: list[TreeLevel]) -> Tensor:
        """The walk over the segment table: the U distinct prompts once, then each level's
        distinct segments once on their parents' keys/values (``levels``: a tree's depths, or
        one level of whole rows, `row_level`), instead of every row re-running what it shares.
        The indexing of parents' caches is differentiable, so a shared segment's gradient is the
        sum over the rows below it, as in one forward per row. Observation images among whole
        rows go with their level, at the positions of whole rows (``get_rope_index``).

        Returns:
            [B, T, V]: the prompt's last position predicts token 0, completion position t-1
            predicts token t.
        """
        device, T = self.device, batch.tokens.shape[1]
        kwargs = rollout.collate(batch.prompts, self.pad_id, device)  # [U, P], vision of U
        obs_vision = self._observation_inputs(batch, device)
        row_pos = None
        if obs_vision:  # images among the completions (one level, whole rows)
            full = self._sequence_kwargs(batch, device, pixels=False)
            fpos = self._prompt_positions(full)  # [3, B, P + T]
            first = torch.zeros(batch.num_prompts(), dtype=torch.long, device=device)
            idx = batch.prompt_index.to(device)
            first.scatter_(0, idx.flip(0), torch.arange(len(batch), device=device).flip(0))
            P = kwargs["input_ids"].shape[1]
            pos, row_pos = fpos[:, first, :P], fpos[:, :, P:]  # [3, U, P], [3, B, T]
        else:
            pos = self._prompt_positions(kwargs)  # [3, U, P]
        if self._keep_arg:
            kwargs["logits_to_keep"] = 1
        out = self.model(**kwargs, position_ids=pos, use_cache=True)
        cache, attn = out.past_key_values, kwargs["attention_mask"]
        tokens, seen = batch.tokens.to(device), completion_attention(batch).to(device, torch.long)
        parts, node_start = [], pos.amax(dim=(0, 2)) + 1  # [N] where each parent's text ends
        for lv in levels:
            parent = lv.parent.to(device)
            cache.batch_select_indices(parent)  # differentiable gather of the parents' K/V
            rows, (a, b) = lv.rows.to(device), lv.cols
            node_start = node_start[parent]
            attn = torch.cat([attn[parent], seen[rows, a:b]], dim=1)
            if row_pos is None:
                cpos = node_start[:, None] + a + torch.arange(b - a, device=device)
                cpos = cpos.expand(3, -1, -1)
            else:
                cpos = row_pos[:, rows, a:b]
            out_l = self.model(
                input_ids=tokens[rows, a:b], attention_mask=attn, position_ids=cpos,
                past_key_values=cache, use_cache=True, **obs_vision,
            )  # fmt: skip
            cache = out_l.past_key_values
            parts.append(out_l.logits)  # [N_d, b - a, V]
        # row b's logits at column j come from the segment holding column j at that depth
        cols = [x if lv.whole_rows else x[lv.of_row.to(device)] for lv, x in zip(levels, parts)]
        full_logits = torch.cat(cols, dim=1)  # [B, T, V]: position j predicts token j + 1
        first_logits = out.logits[:, -1:][batch.prompt_index.to(device)]  # [B, 1, V]
        return torch.cat([first_logits, full_logits[:, : T - 1]], dim=1)

    def _prompt_positions(self, kwargs: dict) -> Tensor:
        """Position ids [3, U, P] of left-padded prompts, as the model derives them in a plain
        forward: M-RoPE from ``get_rope_index`` when the rows carry images, else 0..P-1."""
        ids = kwargs["input_ids"]
        if "mm_token_type_ids" in kwargs and "image_grid_thw" in kwargs:
            pos, _ = self._rope.get_rope_index(
                ids,
                kwargs["mm_token_type_ids"],
                image_grid_thw=kwargs["image_grid_thw"],
                attention_mask=kwargs["attention_mask"],
            )
            return pos
        U, P = ids.shape
        return torch.arange(P, device=ids.device).view(1, 1, P).expand(3, U, P)

    def _shared_image_features(self, batch: RolloutBatch, kwargs: dict) -> None:
        """Replace ``pixel_values`` in ``kwargs`` by image features computed once per distinct
        prompt (``batch.prompts``) and handed to each of its rows, followed by the row's own
        observation images: the same values, and the same gradients summed through the shared
        features, with 1/G of the prompts' vision-tower work. Leaves ``kwargs`` alone when the
        batch has videos."""
        if "pixel_values" not in kwargs or "pixel_values_videos" in kwargs:
            return
        U, seg = batch.num_prompts(), batch.segments
        pix = batch.prompts.get("pixel_values", [None] * U)
        grids = batch.prompts.get("image_grid_thw", [None] * U)
        sources = [("p", u, pix[u], grids[u]) for u in range(U) if pix[u] is not None]
        per = self._image_features(sources + _obs_sources(batch))
        rows = [[]] * len(batch) if seg is None else seg.row_segments(OBSERVATION)
        images = [
            f
            for b, u in enumerate(batch.prompt_index.tolist())
            for f in per.get(("p", u), []) + [f for s in rows[b] for f in per.get(("o", s), [])]
        ]
        del kwargs["pixel_values"]
        kwargs["mm_encoder_outputs"] = _encoder_outputs(images)

    def _image_features(self, sources: list[tuple]) -> dict[tuple, list[Tensor]]:
        """The vision tower once over ``sources`` ((kind, id, pixel_values, image_grid_thw)
        each): ``{(kind, id): [one [tokens_i, D] feature per image]}``."""
        feats = self.model.get_image_features(
            torch.cat([s[2] for s in sources]).to(self.device),
            torch.cat([s[3] for s in sources]).to(self.device),
            return_dict=True,
        ).pooler_output  # one [tokens_i, D] per image, in the order of ``sources``
        per, k = {}, 0
        for kind, i, _, g in sources:
            per[kind, i] = list(feats[k : k + g.shape[0]])
            k += g.shape[0]
        return per

    def _observation_inputs(self, batch: RolloutBatch, device) -> dict:
        """The vision inputs of every row's observation images, in row order: their pixels, or,
        when rows share an observation (a tree of episodes) and the model takes image features,
        each observation segment's features computed once and handed to every row holding it."""
        seg = batch.segments
        if seg is None or not (self._share_vision and seg.shares_vision()):
            return _obs_vision(batch, device)
        per = self._image_features(_obs_sources(batch))
        images = [
            f for segs in seg.row_segments(OBSERVATION) for s in segs for f in per.get(("o", s), [])
        ]
        out = {
            k: v for k, v in _obs_vision(batch, device).items() if not k.startswith("pixel_values")
        }
        return {**out, "mm_encoder_outputs": _encoder_outputs(images)}

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.model.parameters()

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return self.model.named_parameters()

    def state_dict(self) -> dict:
        return self.model.state_dict()

    def load_state_dict(self, state: dict, strict: bool = True):
        return self.model.load_state_dict(state, strict=strict)

    def save(self, path: str | Path) -> None:
        """Write an HF directory (safetensors weights, config, processor) that ``load_vlm`` reads."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path)
        self.processor.save_pretrained(path)

    def load(self, path: str | Path) -> None:
        """Restore in place the weights ``save(path)`` wrote: the parameters stay the same tensors,
        so an optimizer built on them remains valid. (The checkpoint is read through
        ``from_pretrained``, which undoes the key renaming ``save_pretrained`` applies.)"""
        p = check_model_dir(path)
        first = next(self.model.parameters())
        fresh = type(self.model).from_pretrained(
            p, dtype=first.dtype, local_files_only=True, use_safetensors=True
        )
        with torch.no_grad():
            self.model.load_state_dict(fresh.state_dict(), strict=True)
        del fresh

    def train(self, mode: bool = True) -> VLMPolicy:
        self.model.train(mode)
        return self

    def eval(self) -> VLMPolicy:
        return self.train(False)

    @property
    def training(self) -> bool:
        return self.model.training

    def reference(self) -> VLMPolicy:
        """A frozen copy (eval mode, no gradients) for ``logp_ref``."""
        ref_model = copy.deepcopy(self.model)
        ref_model.requires_grad_(False)
        ref = VLMPolicy(
            ref_model, self.processor, self.prompt, self.sampling,
            share_prefix=self.share_prefix, episode=self.episode, tree=self.tree,
        )  # fmt: skip
        return ref.eval()

    # ---- rollout ----------------------------------------------------------------------------

    def encode(
        self, samples: list[dict], *, strict: bool = True, indices: list[int] | None = None
    ) -> tuple[list[EncodedPrompt], list[dict]]:
        """Prompts for ``samples`` with this policy's prompt settings (see ``encode_prompts``)."""
        return encode_prompts(self.processor, samples, self.prompt, strict=strict, indices=indices)

    def completions_batch(
        self, samples: list[dict], completions: list[str] | list[list[str]]
    ) -> RolloutBatch:
        """A batch that scores the given completion texts (e.g. SFT targets): each is tokenized
        and ends with the first stop token (``<|im_end|>``), ``mask`` covers it all. A list of
        turns instead of a text is an episode: the tool calls of its turns run and their
        observations are recorded between them (mask 0; see ``episode.forced_batch``). A
        policy that samples episodes scores every text as an episode (one turn when it is a
        plain text), so its rows join the sampled ones with the same inputs."""
        if self.episode is not None or any(isinstance(c, list) for c in completions):
            from .episode import forced_batch

            return forced_batch(
                self, samples, [c if isinstance(c, list) else [c] for c in completions]
            )
        prompts, _ = self.encode(samples, strict=True)
        return rollout.completions_batch(self.processor, prompts, completions, self.stop_ids)


@dataclass
class TreeLevel:
    """One depth of a tree batch's segments, for the shared-segment forward."""

    cols: tuple[int, int]
    """the completion columns [a, b) the depth's segments occupy (the same in every row)"""
    rows: Tensor
    """[N] a row holding each distinct segment (its tokens are read there)"""
    parent: Tensor
    """[N] each segment's parent: index into the previous depth's segments (the prompt's
    index for the first depth)"""
    of_row: Tensor
    """[B] each row's segment at this depth (a row that ended before it: 0, never read under
    the mask)"""
    whole_rows: bool = False
    """the level is every row's whole completion, in row order (`row_level`)"""


def row_level(batch: RolloutBatch) -> TreeLevel:
    """One level of whole rows below their prompts: how rows that share only their prompt
    (flat groups, episodes, trees whose depths are not aligned) walk the table."""
    B, T = batch.tokens.shape[:2]
    rows = torch.arange(B)
    return TreeLevel((0, T), rows, batch.prompt_index.cpu(), rows, whole_rows=True)


def tree_levels(batch: RolloutBatch) -> list[TreeLevel] | None:
    """The depths of a tree batch, read from its segment table: each depth's segments in the
    order rows first hold them, their parents and each row's own. Needs the segments of a depth
    aligned (all starting at one column, as a single-turn tree's are) and no observations;
    None otherwise (the forward then shares the prompts only)."""
    seg = batch.segments
    if seg is None or not seg.branches or bool((seg.kind == OBSERVATION).any()):
        return None
    depth = seg.depth()
    starts = []
    for d in range(int(depth.max()) + 1):
        first = seg.start[depth == d]
        if not len(first) or bool((first != first[0]).any()):
            return None
        starts.append(int(first[0]))
    if starts[0] != 0 or starts != sorted(set(starts)):
        return None
    bounds, levels = [*starts, batch.tokens.shape[1]], []
    place = torch.zeros(len(seg), dtype=torch.long)  # each segment's place in its depth
    for d, (a, b) in enumerate(zip(bounds, bounds[1:])):
        nodes = (depth == d).nonzero().squeeze(1)
        nodes = nodes[torch.argsort(seg.holder[nodes], stable=True)]
        place[nodes] = torch.arange(len(nodes))
        rows = seg.holder[nodes]
        parent = batch.prompt_index.cpu()[rows] if d == 0 else place[seg.parent[nodes]]
        at = seg.node[:, a]  # each row's segment at the depth's first column (-1: it ended)
        of_row = torch.where(at >= 0, place[at.clamp(min=0)], 0)
        levels.append(TreeLevel((a, b), rows, parent, of_row))
    return levels


def completion_attention(batch: RolloutBatch) -> Tensor:
    """[B, T] 1 where a completion position is attended: the policy's tokens and the
    observations of an episode (the segment table's), 0 on padding."""
    if batch.segments is None:
        return batch.mask
    return batch.segments.attention().to(batch.mask.device)


def _row_obs_vision(batch: RolloutBatch) -> dict[str, list[Tensor | None]]:
    """Each row's observation vision inputs in order, per key (the segment table's)."""
    return {} if batch.segments is None else batch.segments.row_vision()


def _obs_vision(batch: RolloutBatch, device) -> dict[str, Tensor]:
    """The observation images' vision inputs of every row, concatenated in row order."""
    out = {}
    for k, per_row in _row_obs_vision(batch).items():
        present = [v for v in per_row if v is not None]
        if present:
            out[k] = torch.cat(present).to(device)
    return out


def _obs_sources(batch: RolloutBatch) -> list[tuple]:
    """(``"o"``, segment, pixel_values, image_grid_thw) of each observation segment with
    images, once however many rows hold it."""
    vision = [] if batch.segments is None else batch.segments.vision
    return [("o", s, v["pixel_values"], v["image_grid_thw"]) for s, v in enumerate(vision)
            if v and "pixel_values" in v]  # fmt: skip


def _encoder_outputs(images: list[Tensor]) -> dict:
    """``mm_encoder_outputs`` of image features handed to the model (Qwen2/2.5-VL)."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    return {"image": BaseModelOutputWithPooling(pooler_output=images)}
