"""`CompactVLA`: a small vision-language-action policy that learns in minutes on a CPU.

Image (or entity-pose, or entity-token) encoder FiLM-conditioned on the instruction, proprio
input, a diagonal Gaussian action head with a state-independent log-std, and a value head on a
shared trunk, or (``critic="state"``) an asymmetric critic: a separate MLP that reads the
simulator's true entity poses (Pinto et al. 2018), while the actor still sees only pixels,
proprio and the instruction.
With ``aux="subject"`` an auxiliary head on the actor's trunk regresses the position of the
entity the instruction names (entity 0 of the poses, by the sim tasks' convention) relative to the
tool centre point (a supervised loss on privileged simulator state, returned in
:meth:`CompactVLA.evaluate`'s ``aux``): it teaches the encoder to find the named object long
before the policy gradient alone would. Neither changes what the actor reads.
Image encoders: ``cnn`` (Nature-CNN, flattened features) or ``keypoint`` (three convolutions
at 32x32 / 16x16 followed by a spatial softmax: each channel becomes the expected (x, y) image
position of its activation, which makes "where is the named object" a direct input).
State encoders: ``state`` (an MLP on the entity poses, whose order names the subject: entity 0)
or ``entities`` (`EntityReader`: every entity a token of its pose, kind and colour, read in any
order; queries made from the instruction attend over them, so the policy finds the entities the
instruction names by their words: one policy for any subgoal of a scene).

Observations travel as a dict of tensors (see :meth:`CompactVLA.observe`): ``image``
[N, H, W, 3 * cameras] uint8 (the env's cameras stacked on channels, kept uint8 until the forward;
one conv tower shared by the cameras, features concatenated), ``proprio`` [N, P] float, ``objects`` [N, O] float (state
encoder, or the state critic), ``words`` [N, L] long instruction token ids (0 = padding; see
`vla.language`: word ids, 1 an unknown word, or MiniLM's wordpieces).

In a `RolloutBatch`, each of these is a per-sample list of [T_i, ...] tensors (one entry per
valid step, no padding), ``tokens`` holds the raw sampled actions [B, T, K * A] and ``mask`` is
right-padded with ``mask[i].sum() == T_i``. Actions are *not* squashed: the log-prob is that of
the raw sample; the collector clips to [-1, 1] only when it sends them to the env.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.distributions import Normal

from ..errors import ModelError
from ..registry import VLA_HEADS
from ..sim.composite import ENTITY_SIZE, POSE_SIZE
from ..trainer.batch import RolloutBatch
from ..trainer.policy import Evaluation
from . import hub
from .config import AUX, CRITICS, ENCODERS, IMAGE_ENCODERS, VLAConfig
from .language import InstructionEncoder, instruction_words
from .model_card import write_extras

WORKSPACE_CENTRE = (0.5, 0.0, 0.2)
"""metres; positions enter the network as (p - centre) / POS_SCALE so that they are O(1)"""
POS_SCALE = 0.1
GRIPPER_SCALE = 100.0
"""the gripper opening enters the network in cm"""
OBS_KEYS = ("image", "proprio", "objects", "words")
WEIGHTS, CONFIG = hub.WEIGHTS, hub.CONFIG


@dataclass
class CompactSpec:
    """Everything needed to rebuild a `CompactVLA` (written to config.json)."""

    action_dim: int
    """env action dimensions A"""
    chunk: int = 1
    """K actions per policy step (the head outputs K * A)"""
    proprio_dim: int = 8
    objects_dim: int = 0
    """entity-pose size (state encoder or state critic)"""
    image_size: int = 64
    cameras: int = 1
    """camera images per observation (each goes through the same conv tower)"""
    vla: VLAConfig = field(default_factory=VLAConfig)
    """the recipe's ``vla`` section: encoder, widths, instruction encoder, critic, auxiliary
    loss (its ``policy`` is "compact")"""
    words: list[str] = field(default_factory=list)
    """instruction vocabulary (ids 2...; empty builds it from the registered sim tasks)"""


class FiLM(nn.Module):
    """Feature-wise affine modulation ``x * (1 + gamma(e)) + beta(e)``; starts as the identity."""

    def __init__(self, cond_dim: int, channels: int):
        super().__init__()
        self.proj = nn.Linear(cond_dim, 2 * channels)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: Tensor, cond: Tensor) -> Tensor:
        gamma, beta = self.proj(cond).chunk(2, dim=-1)  # (N, C) each
        shape = (x.shape[0], -1) + (1,) * (x.dim() - 2)
        return x * (1 + gamma.view(shape)) + beta.view(shape)


class SpatialSoftmax(nn.Module):
    """Feature maps [N, C, H, W] -> expected (x, y) position of each channel's softmax over the
    map, in [-1, 1]: [N, 2C] (Levine et al. 2016), with a learned temperature."""

    def __init__(self, height: int, width: int):
        super().__init__()
        ys, xs = torch.meshgrid(
            torch.linspace(-1, 1, height), torch.linspace(-1, 1, width), indexing="ij"
        )
        grid = torch.stack([xs.flatten(), ys.flatten()], dim=-1)  # (H*W, 2)
        self.register_buffer("grid", grid, persistent=False)
        self.log_temp = nn.Parameter(torch.zeros(()))

    def forward(self, x: Tensor) -> Tensor:
        N, C, H, W = x.shape
        if H * W != self.grid.shape[0]:
            raise ValueError(
                f"SpatialSoftmax built for {self.grid.shape[0]} cells got maps {H}x{W}; the "
                "image size differs from the policy's spec.image_size"
            )
        attn = torch.softmax(x.flatten(2) / self.log_temp.exp(), dim=-1)  # (N, C, H*W)
        return (attn @ self.grid).flatten(1)  # (N, C, 2) -> (N, 2C)


class EntityReader(nn.Module):
    """Entity tokens [N, E, ENTITY_SIZE] (normalised pose, kind and colour one-hots), the tool
    centre point [N, 3] and the instruction (`InstructionEncoder.encode`) -> features [N, H].

    Each entity becomes a token (an MLP of its features and its offset from the gripper) and
    reads what the instruction says about it: it attends over the instruction's word vectors
    (its colour and kind against the words; a GRU's vector at a word carries the words before
    it, so "put the red block in the blue bowl" tells the red block it is moved and the blue
    bowl that it is the goal). Then ``heads`` queries made from the whole instruction attend
    over the tokens (softmax over E: any number of entities, in any order), and the attended
    tokens, concatenated, are projected to H."""

    def __init__(self, cond_dim: int, hidden: int, heads: int = 4):
        super().__init__()
        self.heads, self.hidden = heads, hidden
        self.token = nn.Sequential(
            nn.Linear(ENTITY_SIZE + 3, hidden), nn.ReLU(), nn.Linear(hidden, hidden)
        )
        self.ask = nn.Linear(hidden, cond_dim)
        self.told = nn.Sequential(nn.Linear(hidden + cond_dim, hidden), nn.ReLU())
        self.key = nn.Linear(hidden, hidden)
        self.query = nn.Linear(cond_dim, heads * hidden)
        self.out = nn.Linear(heads * hidden, hidden)

    def forward(
        self, entities: Tensor, tcp: Tensor, instruction: tuple[Tensor, Tensor, Tensor]
    ) -> Tensor:
        cond, words, valid = instruction  # (N, C), (N, L, C), (N, L)
        N, C = len(entities), cond.shape[-1]
        tok = self.token(torch.cat([entities, entities[..., :3] - tcp[:, None]], -1))  # (N, E, H)
        valid = valid.clone()
        valid[:, 0] = True  # an empty instruction: attend to its padding, not to nothing
        said = torch.einsum("nec,nlc->nel", self.ask(tok), words) / C**0.5
        said = torch.softmax(said.masked_fill(~valid[:, None], float("-inf")), -1)
        tok = self.told(torch.cat([tok, torch.einsum("nel,nlc->nec", said, words)], -1))
        q = self.query(cond).view(N, self.heads, self.hidden)  # (N, heads, H)
        att = torch.softmax(
            torch.einsum("nqh,neh->nqe", q, self.key(tok)) / self.hidden**0.5, -1
        )  # (N, heads, E)
        return self.out(torch.einsum("nqe,neh->nqh", att, tok).flatten(1))  # (N, H)


def _check_spec(spec: CompactSpec) -> None:
    """The names a spec built without a recipe may still get wrong, and the privileged options
    without the poses they read."""
    for name, valid in (("encoder", ENCODERS), ("critic", CRITICS), ("aux", AUX)):
        value = getattr(spec.vla, name)
        if value not in valid:
            raise ValueError(f"vla.{name}={value!r}; valid: {' | '.join(valid)}")
    VLA_HEADS.entry(spec.vla.head)  # UnknownName (a ValueError) lists the registered heads
    for what, on in (
        ("vla.critic=state", spec.vla.critic == "state"),
        (f"vla.aux={spec.vla.aux}", spec.vla.aux != "none"),
    ):
        if on and spec.objects_dim <= 0:
            raise ValueError(
                f"{what} reads the true entity poses; set env.privileged_state=true (rgb "
                "mode) so the env returns them"
            )
    if spec.vla.encoder == "entities":
        if spec.objects_dim <= 0 or spec.objects_dim % ENTITY_SIZE:
            raise ValueError(
                f"vla.encoder=entities reads {ENTITY_SIZE} numbers per entity; objects_dim="
                f"{spec.objects_dim} (set env.obs_mode=state and env.entity_features=true)"
            )


class CompactVLA(nn.Module):
    """CNN (or state MLP) + FiLM + proprio -> Gaussian action head and value head."""

    def __init__(self, spec: CompactSpec):
        super().__init__()
        _check_spec(spec)
        if not spec.words:
            spec.words = instruction_words()
        self.spec = spec
        self.vocab = {w: i + 2 for i, w in enumerate(spec.words)}
        E, H = spec.vla.embed_dim, spec.vla.hidden
        self.instr = InstructionEncoder(
            len(self.vocab) + 2, E, spec.vla.instruction_encoder, spec.vla.instruction_projection
        )
        self.keypoints = None
        if spec.vla.encoder in IMAGE_ENCODERS:
            c1, c2, c3 = spec.vla.channels
            if spec.vla.encoder == "cnn":
                convs = [nn.Conv2d(3, c1, 8, 4), nn.Conv2d(c1, c2, 4, 2), nn.Conv2d(c2, c3, 3, 1)]
            else:
                convs = [nn.Conv2d(3, c1, 5, 2, 2), nn.Conv2d(c1, c2, 3, 2, 1),
                         nn.Conv2d(c2, c3, 3, 1, 1)]  # fmt: skip
                side = (spec.image_size + 3) // 4
                self.keypoints = SpatialSoftmax(side, side)
            self.convs = nn.ModuleList(convs)
            self.films = nn.ModuleList([FiLM(E, c) for c in (c1, c2, c3)])
            with torch.no_grad():
                n_feat = self._cnn(torch.zeros(1, 3, spec.image_size, spec.image_size), None)
            self.feat = nn.Linear(n_feat.shape[1] * spec.cameras, H)
        elif spec.vla.encoder == "entities":
            self.reader = EntityReader(E, H)
            self.films = nn.ModuleList([FiLM(E, H)])
        else:
            if spec.objects_dim <= 0:
                raise ValueError("the state encoder needs objects_dim > 0 (obs_mode=state)")
            self.feat = nn.Linear(spec.objects_dim + spec.proprio_dim, H)
            self.films = nn.ModuleList([FiLM(E, H)])
        self.trunk = nn.Sequential(nn.Linear(H + spec.proprio_dim + E, H), nn.ReLU())
        self._build_head(H, spec.action_dim * spec.chunk)
        self.value_head = self.critic = None
        if spec.vla.critic == "shared":
            self.value_head = nn.Linear(H, 1)
        else:
            self.critic = nn.Sequential(
                nn.Linear(spec.objects_dim + spec.proprio_dim, H), nn.ReLU(),
                nn.Linear(H, H), nn.ReLU(), nn.Linear(H, 1),
            )  # fmt: skip
        self.aux_head = None
        if spec.vla.aux == "subject":
            self.aux_head = nn.Linear(H, 3)

    def _build_head(self, hidden: int, dim: int) -> None:
        """The action head on the trunk's features: a diagonal Gaussian (mean layer and a
        state-independent log-std). `FlowVLA` builds its flow-matching head here instead."""
        self.mean_head = nn.Linear(hidden, dim)
        nn.init.normal_(self.mean_head.weight, std=0.01)
        nn.init.zeros_(self.mean_head.bias)
        self.log_std = nn.Parameter(torch.full((dim,), self.spec.vla.init_log_std))

    # ------------------------------------------------------------------ forward
    @property
    def device(self) -> torch.device:
        return self.trunk[0].weight.device

    def _cnn(self, img: Tensor, cond: Tensor | None) -> Tensor:
        """Images [N, 3, H, W] -> features [N, F] (flattened maps, or 2 * C3 keypoints)."""
        x = img
        for i, conv in enumerate(self.convs):
            x = conv(x)
            if cond is not None:
                x = self.films[i](x, cond)
            if self.keypoints is None or i < len(self.convs) - 1:
                x = torch.relu(x)
        return x.flatten(1) if self.keypoints is None else self.keypoints(x)

    def _normalise(self, proprio: Tensor, objects: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """Positions (proprio tcp xyz, entity xyz) -> O(1) workspace coordinates; the gripper
        width in cm. Quaternions are unchanged."""
        c = proprio.new_tensor(WORKSPACE_CENTRE)
        p = proprio.clone()
        p[:, :3] = (p[:, :3] - c) / POS_SCALE
        if p.shape[1] == 8:
            p[:, 7] = p[:, 7] * GRIPPER_SCALE
        size = ENTITY_SIZE if self.spec.vla.encoder == "entities" else POSE_SIZE
        if objects is not None and objects.shape[1] % size == 0:
            o = objects.reshape(len(objects), -1, size).clone()  # (N, entities, size)
            o[..., :3] = (o[..., :3] - c) / POS_SCALE
            objects = o.flatten(1)
        return p, objects

    def forward(self, obs: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """Flat observations (N rows) -> (action mean [N, K*A], value [N])."""
        h, value, _ = self._features(obs)
        return self.mean_head(h), value

    def _features(self, obs: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor | None]:
        """(trunk features [N, H], value [N], auxiliary loss per row [N] or None): everything
        but the action head.

        Without the privileged poses (an env without ``privileged_state``: evaluation or
        deployment) an image policy still acts; its state critic's value is NaN then and the
        auxiliary loss None. The state encoder always needs them."""
        instruction = self.instr.encode(obs["words"])
        cond = instruction[0]  # (N, E)
        has_objects = "objects" in obs and "objects" in self.obs_keys()
        objects = obs["objects"].float() if has_objects else None
        proprio, objects = self._normalise(obs["proprio"].float(), objects)  # (N, P), (N, O)
        if self.spec.vla.encoder in IMAGE_ENCODERS:
            N, S, C = len(cond), self.spec.image_size, self.spec.cameras
            img = obs["image"].permute(0, 3, 1, 2).float() / 255.0 - 0.5  # (N, 3C, H, W)
            feats = self._cnn(img.reshape(N * C, 3, S, S), cond.repeat_interleave(C, 0))
            h = self.feat(feats.reshape(N, -1))  # (N*C, F) -> (N, C*F) -> (N, H)
        elif self.spec.vla.encoder == "entities":
            entities = objects.reshape(len(objects), -1, ENTITY_SIZE)  # (N, E, ENTITY_SIZE)
            h = self.films[0](self.reader(entities, proprio[:, :3], instruction), cond)
        else:
            h = self.feat(torch.cat([objects, proprio], dim=-1))
            h = self.films[0](h, cond)
        h = self.trunk(torch.cat([torch.relu(h), proprio, cond], dim=-1))  # (N, H)
        aux = None
        if self.aux_head is not None and objects is not None:  # xyz relative to the tcp
            rel = objects[:, :3] - proprio[:, :3]  # entity 0 is the one the instruction names
            aux = (self.aux_head(h) - rel).square().mean(-1)
        if self.value_head is not None:
            value = self.value_head(h).squeeze(-1)
        elif objects is None:  # a state critic without the poses: no value
            value = h.new_full((len(h),), float("nan"))
        else:  # the entity order names the target: no instruction needed
            value = self.critic(torch.cat([objects, proprio], -1)).squeeze(-1)
        return h, value, aux

    def distribution(self, mean: Tensor) -> Normal:
        return Normal(mean, self.log_std.exp().expand_as(mean))

    # ------------------------------------------------------------------ policy protocol
    has_critic = True
    """a value head on the trunk, or the state critic (NaN values without the poses)"""
    origin: hub.Origin | None = None
    """the env and run it was trained on, which `save` records (set by the VLA builder, or read
    back by `from_pretrained`)"""

    def evaluate(self, batch: RolloutBatch) -> Evaluation:
        """Re-score the batch's actions: logp, entropy and value, each [B, T] (0 on padding),
        and the auxiliary losses the trainer adds to its loss (name -> [B, T] per-step loss,
        already weighted; empty with ``aux="none"``).

        Only the valid steps go through the network (the inputs carry no padding)."""
        mask = batch.mask > 0  # (B, T)
        h, value, aux = self._features(flatten_inputs(batch, self.obs_keys()))  # N valid steps
        dist = self.distribution(self.mean_head(h))
        actions = batch.tokens[mask].to(h.dtype)  # (N, D): row-major order = concat order
        return self._evaluation(
            mask, dist.log_prob(actions).sum(-1), dist.entropy().sum(-1), value, aux
        )

    def _evaluation(self, mask: Tensor, logp: Tensor, entropy: Tensor, value: Tensor, aux):
        """Per-valid-step [N, ...] terms -> an `Evaluation` of [B, T, ...] tensors (0 on
        padding)."""
        per_step = [logp, entropy, value] + (
            [self.spec.vla.aux_coef * aux] if aux is not None else []
        )
        out = []
        for x in per_step:
            full = x.new_zeros(*mask.shape, *x.shape[1:])
            full[mask] = x
            out.append(full)
        return Evaluation(
            out[0], out[1], out[2], {self.spec.vla.aux: out[3]} if aux is not None else {}
        )

    @torch.no_grad()
    def act(
        self, obs: dict[str, Tensor], deterministic: bool = False
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Observations [N, ...] -> (action [N, K*A] raw (unclipped), logp [N], value [N])."""
        obs = {k: v.to(self.device, non_blocking=True) for k, v in obs.items()}
        mean, value = self(obs)
        dist = self.distribution(mean)
        action = mean if deterministic else dist.sample()
        return action, dist.log_prob(action).sum(-1), value

    @torch.no_grad()
    def value(self, obs: dict[str, Tensor]) -> Tensor:
        """Observations [N, ...] -> critic value [N], without sampling an action (the bootstrap
        at a rollout horizon or a time limit; the same number ``act`` returns for ``obs``)."""
        obs = {k: v.to(self.device, non_blocking=True) for k, v in obs.items()}
        return self._features(obs)[1]

    def obs_keys(self) -> tuple[str, ...]:
        if self.spec.vla.encoder not in IMAGE_ENCODERS:
            return ("objects", "proprio", "words")
        privileged = self.spec.vla.critic == "state" or self.spec.vla.aux != "none"
        return ("image", "proprio", "words") + (("objects",) if privileged else ())

    def observe(self, batch) -> dict[str, Tensor]:
        """A ``sim.vector.Batch`` (numpy, N envs) -> CPU observation tensors for ``act``."""
        obs = {
            "proprio": torch.as_tensor(np.asarray(batch.proprio, np.float32)),
            "words": self.instr.tokenize(batch.instructions, self.vocab, self.spec.vla.max_words),
        }
        if self.spec.vla.encoder in IMAGE_ENCODERS:
            if not batch.images:
                raise ValueError(
                    "the cnn encoder needs camera images; make the env with env.obs_mode=rgb "
                    "(or use vla.encoder=state)"
                )
            if len(batch.images) != self.spec.cameras:
                raise ValueError(
                    f"the policy reads {self.spec.cameras} camera(s) but the env renders "
                    f"{sorted(batch.images)}; set env.cameras to match the policy"
                )
            cams = list(batch.images.values())
            if isinstance(cams[0], Tensor):  # the warp backend renders into device tensors
                obs["image"] = torch.cat(cams, dim=-1)
            else:
                obs["image"] = torch.as_tensor(np.concatenate(cams, axis=-1))
            if "objects" in self.obs_keys() and batch.objects is not None:  # training signals
                obs["objects"] = torch.as_tensor(np.asarray(batch.objects, np.float32))
        else:
            if batch.objects is None:
                raise ValueError("vla.encoder=state needs env.obs_mode=state (entity poses)")
            obs["objects"] = torch.as_tensor(np.asarray(batch.objects, np.float32))
        return obs

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | Path) -> None:
        """Write the policy folder (`vla.hub`): ``model.safetensors``, ``config.json`` (model_type,
        format version and the `CompactSpec`), ``policy_spec.json`` and the model card."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(path / WEIGHTS))
        manifest = hub.Manifest(hub.model_type(self.spec.vla.head), hub.FORMAT_VERSION)
        cfg = {
            "model_type": manifest.model_type,
            "version": manifest.version,
            "policy": "compact",
            **asdict(self.spec),  # the vla section nested under "vla"
        }
        (path / CONFIG).write_text(json.dumps(cfg, indent=1))
        write_extras(path, self.describe(), manifest, self.origin)

    def describe(self, origin: hub.Origin | None = None) -> dict:
        """What the policy reads and emits (``policy_spec.json``'s features, normalisation and
        instruction encoder), on the env of ``origin`` (default: its own)."""
        return hub.compact_description(
            self.spec, origin or self.origin, WORKSPACE_CENTRE, POS_SCALE, GRIPPER_SCALE
        )

    def load(self, path: str | Path) -> None:
        """Restore in place the weights ``save(path)`` wrote (same tensors: optimizers stay valid);
        damaged or mismatched weights are a `ModelError` naming the file."""
        weights = _checked(path) / WEIGHTS
        try:
            state = load_file(str(weights), device=str(self.device))
            with torch.no_grad():
                self.load_state_dict(state, strict=True)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelError(
                f"cannot load the VLA weights {weights} ({type(e).__name__}: "
                f"{str(e).strip().splitlines()[0][:300]}): the file is damaged or was written "
                "for another config.json; copy the folder again or use another checkpoint"
            ) from e

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str | torch.device = "cpu") -> CompactVLA:
        """Build the policy ``save(path)`` wrote and load its weights, after checking the folder
        (`hub.read_manifest`, `hub.read_origin`: a `ModelError` names what is wrong)."""
        manifest = hub.read_manifest(path)
        config = Path(path) / CONFIG
        try:
            spec = spec_from_json(json.loads(config.read_text()))
        except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
            raise ModelError(
                f"{config} does not describe a CompactVLA ({type(e).__name__}: {e}); is it "
                "another kind of model (an HF VLM folder)? Pass the `model` folder of a VLA "
                "checkpoint written by policy.save"
            ) from e
        if manifest.head != spec.vla.head:
            raise ModelError(
                f"{config}: model_type {manifest.model_type} but vla.head={spec.vla.head}; the "
                "file was edited, copy the folder again"
            )
        policy = build_compact(spec).to(device)
        policy.origin = hub.read_origin(path, lambda origin: policy.describe(origin))
        policy.load(path)
        return policy


VLA_HEADS.register("gaussian", CompactVLA)


def build_compact(spec: CompactSpec) -> CompactVLA:
    """The compact policy of the head ``spec.vla.head`` names in `VLA_HEADS`: `CompactVLA`
    (``gaussian``) or `vla.flow.FlowVLA` (``flow``)."""
    return VLA_HEADS.get(spec.vla.head)(spec)


def _checked(path: str | Path) -> Path:
    path = Path(path)
    missing = [n for n in (WEIGHTS, CONFIG) if not (path / n).exists()]
    if missing:
        raise ModelError(
            f"{path} is not a CompactVLA checkpoint (missing {', '.join(missing)}); pass the "
            "`model` folder of a checkpoint written by policy.save"
        )
    return path


def flatten_inputs(batch: RolloutBatch, keys: Sequence[str]) -> dict[str, Tensor]:
    """Concatenate the per-sample step lists of ``batch.inputs`` -> [N, ...] per key, where
    N = number of valid steps; checks that each row's list length matches its mask."""
    lens = (batch.mask > 0).sum(1).tolist()
    flat = {}
    for k in keys:
        if k not in batch.inputs:
            raise KeyError(
                f"RolloutBatch.inputs lacks {k!r} (has {sorted(batch.inputs)}); the batch was "
                "collected for another observation mode or policy"
            )
        rows = batch.inputs[k]
        got = [int(x.shape[0]) for x in rows]
        if got != lens:
            raise ValueError(
                f"inputs[{k!r}] step counts {got[:8]} do not match the mask's valid steps "
                f"{lens[:8]}; masks must be right-padded with one input per valid step"
            )
        flat[k] = torch.cat(list(rows), dim=0)
    return flat


def camera_keys(obs_space) -> list[str]:
    """Names of the image entries ([H, W, 3] boxes) of an env's Dict observation space."""
    return [k for k, sp in obs_space.spaces.items() if len(getattr(sp, "shape", None) or ()) == 3]


def spec_from_config(vla: VLAConfig, env_spaces: dict, chunk: int, image_size: int) -> CompactSpec:
    """A `CompactSpec` from the recipe's ``vla`` section and the env's single spaces
    (``action``: Box (A,), ``observation``: Dict)."""
    obs = env_spaces["observation"]
    return CompactSpec(
        action_dim=int(env_spaces["action"].shape[0]), chunk=chunk,
        proprio_dim=int(obs["proprio"].shape[0]),
        objects_dim=int(obs["objects"].shape[0]) if "objects" in obs.spaces else 0,
        image_size=image_size, cameras=max(1, len(camera_keys(obs))),
        vla=dataclasses.replace(
            vla, channels=list(vla.channels), flow_noise_std=list(vla.flow_noise_std)
        ),
    )  # fmt: skip


def spec_from_json(cfg: dict) -> CompactSpec:
    """The `CompactSpec` of a ``config.json`` that ``save`` wrote (its ``vla`` section nested;
    checkpoints written before it was nested hold its fields at the top level; model_type and
    version are the folder's, `hub.read_manifest`)."""
    cfg = {k: v for k, v in cfg.items() if k not in ("policy", "model_type", "version")}
    names = {f.name for f in dataclasses.fields(VLAConfig)}
    vla = {
        **{k: cfg.pop(k) for k in list(cfg) if k in names and k != "policy"},
        **cfg.pop("vla", {}),
    }
    return CompactSpec(**cfg, vla=VLAConfig(**vla))
