"""Multi-turn episodes as data: settings, the environment that answers a turn, the storage tape.

An episode is a trajectory of segments after the prompt: policy turns (tokens the policy
sampled, each turn ending with the stop token or, with ``rollout.episode.stop``, right after
one of its stop strings, the stop token then opening the observation) and observations (what a
tool or an environment answered, rendered as a new chat turn through the processor's own chat
template: text and images). Its `RolloutBatch` row is laid out like a single completion, so the
trainer needs nothing new:

* ``tokens`` [B, T]: every token after the prompt, policy and observation, right-padded;
* ``mask`` [B, T]: 1 on the policy's own tokens only (the loss), 0 on observations and padding;
* ``segments`` (``trainer/segments.py``): each turn a policy segment, each observation an
  observation segment (in the context, out of the loss: ``segments.attention()`` is what a
  forward attends to), in a tree shared by the rows below a fork;
* ``inputs["obs_<key>"]`` [B, T]: per-token processor outputs of the observations (Qwen's
  ``mm_token_type_ids``: which positions are image placeholders), 0 elsewhere;
* ``segments.vision``: each observation segment's vision inputs (any vision key the processor
  returns), stored once however many rows hold it (``segments.row_vision()``: per row).

The structure is written down when the episode is recorded, never rediscovered from token
values. The estimators treat the observation holes in ``mask`` as interior holes (a later reward
reaches earlier turns), and ``VLMPolicy.evaluate`` places every observation image at its place
in the training forward (see ``vlm/policy.py``).

The environment is a protocol (`EpisodeEnv`: ``reset(samples)``, ``respond(row, text)``):
`tool_env.ToolEnv` answers tool calls; a simulator executing a planner's subgoals is another.
A recipe names one (``rollout.episode.env``) from ``perceptrl.registry.EPISODE_ENVS``.
`sampler.Rollouts` samples episodes (on either engine); `forced_batch` records given turn
texts (SFT traces) the same way.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from PIL import Image
from torch import Tensor

from ..rewards.registry import RewardContext
from ..trainer.batch import RolloutBatch
from ..trainer.segments import OBSERVATION, POLICY, Segments
from .tools import Observation

STOP_REASONS = (
    "answer",
    "turn_length",
    "max_tokens",
    "max_turns",
    "max_images",
    "max_vision_tokens",
)
"""Why an episode ended: a turn without a tool call (``answer``), a turn that reached
``rollout.max_new_tokens`` without ending, or a budget of ``rollout.episode``."""
STOP_STRING = "stop_string"
"""A turn that ended right after one of ``EpisodeSettings.stop`` (not why an episode ends: the
turn is answered like one that ended with the stop token)."""
ANSWERED = (None, STOP_STRING)
"""How a turn the environment answers ended (``None``: at the stop token); any other reason
ends the episode."""


@dataclass
class EpisodeSettings:
    """Budgets and the environment of multi-turn rollouts, built once from ``rollout.episode``
    and handed to the policy (the rollout source and the evaluator read ``policy.episode``)."""

    env: Callable[[], EpisodeEnv]
    """makes the environment that answers policy turns (one per rollout call)"""
    max_turns: int = 4
    """policy turns per episode"""
    max_tokens: int = 512
    """tokens after the prompt per episode: policy turns and observations together"""
    max_images: int = 4
    """observation images per episode"""
    max_vision_tokens: int = 1024
    """observation vision tokens per episode"""
    observation_role: str = "user"
    """chat role of observation turns (``user``, or ``tool`` for templates that render it)"""
    min_pixels: int | None = None
    """smallest observation image area after resizing (None: the processor's)"""
    max_pixels: int | None = None
    """largest observation image area after resizing (None: the processor's)"""
    tool_names: tuple[str, ...] = ()
    """the tools listed to the model (system prompt), for the record"""
    stop: tuple[str, ...] = ()
    """strings that end a policy turn (e.g. ``</subgoal>``): the turn keeps the string, and the
    stop token that closes it in the chat template opens the observation (out of the loss)"""


class EpisodeEnv(Protocol):
    """What answers a policy turn: one episode per row of a rollout call."""

    def reset(self, samples: list[dict]) -> None:
        """Start one episode per sample (row ``i`` is ``samples[i]``)."""
        ...

    def respond(self, row: int, text: str) -> Observation | None:
        """The observation that follows policy turn ``text`` of episode ``row``, or None when
        the turn ends the episode (an answer). Must not raise on anything the policy wrote."""
        ...

    # Optional, for tree rollouts of episodes (``rollout.tree``): ``fork(src, dst)`` makes
    # episode ``dst`` a copy of episode ``src`` as it stands (the branches then go on apart).
    # Optional: ``prepare(rows, texts)``, called with a round's turns that will be answered,
    # before `respond` answers them one by one: an environment may do their work together
    # there (`vla.plan_env.PlanEnv` executes all the rows' subgoals side by side).


# ---------------------------------------------------------------------------------------------
# observations through the chat template
# ---------------------------------------------------------------------------------------------


@dataclass
class ObservationKeys:
    """What the processor returns for an observation: per-token keys (with their dtypes) and
    vision keys, found once from a probe so every batch carries the same ``inputs`` keys."""

    extras: dict[str, torch.dtype]
    vision: tuple[str, ...]


@dataclass
class EncodedObservation:
    ids: Tensor
    """[O] long token ids (image placeholders expanded)"""
    extras: dict[str, Tensor]
    """per-token processor outputs, each [O] (e.g. mm_token_type_ids)"""
    vision: dict[str, Tensor]
    """vision inputs of its images (pixel_values, image_grid_thw ...)"""
    num_images: int = 0
    num_vision_tokens: int = 0
    images: list[Image.Image] = field(default_factory=list)
    """the observation's images as the tool returned them (an engine that expands placeholders
    itself, vLLM, is sent these)"""


class ObservationTemplate:
    """Renders an observation as the tokens that follow a policy turn, with the processor's own
    chat template: the template's text after an assistant turn's stop token, then the new turn
    (images first, then text), then the generation prompt of the next assistant turn. Earlier
    turns are never re-rendered or re-tokenized (the policy's tokens stay what it sampled).

    Raises:
        ValueError: the template does not end an assistant turn with ``stop_text`` or renders
            earlier turns differently once a turn is added (it cannot be continued).
    """

    def __init__(self, processor, stop_text: str, settings: EpisodeSettings):
        self.processor, self.role = processor, settings.observation_role
        self.stop_text = stop_text
        self._msgs = [
            {"role": "user", "content": [{"type": "text", "text": "Q"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "A"}]},
        ]
        self._base = processor.apply_chat_template(self._msgs, tokenize=False)
        i = self._base.rfind(stop_text)
        if i < 0:
            raise ValueError(
                f"the chat template does not end an assistant turn with {stop_text!r}; episodes "
                "need a template whose turns end with the stop token"
            )
        self._glue = self._base[i + len(stop_text) :]
        self._keys: ObservationKeys | None = None
        self._takes_images = getattr(processor, "image_processor", None) is not None
        self._size: dict[str, int] = {}
        if settings.min_pixels or settings.max_pixels:
            self._size = dict(processor.image_processor.size)
            if settings.min_pixels:
                self._size["shortest_edge"] = settings.min_pixels
            if settings.max_pixels:
                self._size["longest_edge"] = settings.max_pixels

    def text(self, obs: Observation, close: bool = False) -> str:
        """The observation's text after a policy turn; ``close``: the turn ended at a stop string,
        so the text starts with the stop token that closes it."""
        content: list[dict] = [{"type": "image"} for _ in obs.images]
        if obs.text or not obs.images:
            content.append({"type": "text", "text": obs.text})
        full = self.processor.apply_chat_template(
            [*self._msgs, {"role": self.role, "content": content}],
            tokenize=False,
            add_generation_prompt=True,
        )
        if not full.startswith(self._base):
            raise ValueError(
                "the chat template renders earlier turns differently once a turn is added; "
                "episodes need a template that only appends"
            )
        return (self.stop_text if close else "") + self._glue + full[len(self._base) :]

    def keys(self) -> ObservationKeys:
        """The processor's output keys for observations (a probe with one small image, or text
        for a text-only model, whose processor has no image processor)."""
        if self._keys is None:
            images = [Image.new("RGB", (56, 56))] if self._takes_images else []
            probe = self.encode(Observation("x", images), [])
            self._keys = ObservationKeys(
                {k: v.dtype for k, v in probe.extras.items()}, tuple(sorted(probe.vision))
            )
        return self._keys

    def encode_or_error(
        self, obs: Observation, vision_ids: list[int], close: bool = False
    ) -> tuple[EncodedObservation, Observation]:
        """`encode`, or, when the processor refuses the observation's images (a zoom into a
        2-px sliver has an aspect ratio Qwen's resizer rejects), an error observation in its
        place, counted under the tool's name like any failed call. Returns what is shown."""
        try:
            return self.encode(obs, vision_ids, close), obs
        except Exception as e:  # the processor's ValueError, or a PIL error on a bad image
            if not obs.images:
                raise  # text alone always encodes; anything else is a bug, not bad input
            name = obs.tool or "observation"
            err = Observation(
                f"Error: {name} returned an image the model cannot take ({e})",
                error=name, tool=obs.tool, info=obs.info,
            )  # fmt: skip
            return self.encode(err, vision_ids, close), err

    def encode(
        self, obs: Observation, vision_ids: list[int], close: bool = False
    ) -> EncodedObservation:
        kwargs: dict[str, Any] = {}
        if obs.images and self._size:
            kwargs["images_kwargs"] = {"size": self._size}
        enc = self.processor(
            text=[self.text(obs, close)], images=obs.images or None, return_tensors="pt", **kwargs
        )
        ids = enc["input_ids"][0]
        extras, vision = {}, {}
        for k, v in enc.items():
            if k in ("input_ids", "attention_mask") or not isinstance(v, Tensor):
                continue
            if v.shape == enc["input_ids"].shape:
                extras[k] = v[0]
            else:
                vision[k] = v
        n_vis = int(torch.isin(ids, torch.tensor(vision_ids)).sum()) if vision_ids else 0
        return EncodedObservation(ids, extras, vision, len(obs.images), n_vis, list(obs.images))


# ---------------------------------------------------------------------------------------------
# recording episodes
# ---------------------------------------------------------------------------------------------


@dataclass
class EpisodeLog:
    """What happened in one episode (``meta["episode"]`` of its row, for rewards and metrics)."""

    turns: int = 0
    calls: int = 0
    """turns answered with an observation (valid or not)"""
    errors: Counter = field(default_factory=Counter)
    """error counter -> calls that failed (tool name, malformed, unknown)"""
    tools: Counter = field(default_factory=Counter)
    """tool name -> calls that ran"""
    stop: str = ""
    texts: list[str] = field(default_factory=list)
    """decoded policy turns"""
    observations: list[str] = field(default_factory=list)
    """observation texts shown to the model"""
    observation_images: list[list[Image.Image]] = field(default_factory=list)
    """each observation's images as the tool returned them (for the rollout records)"""
    images: int = 0
    vision_tokens: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    """merged ``Observation.info`` of the episode (e.g. an executor's outcome)"""
    turn_seconds: list[float] = field(default_factory=list)
    """wall time of each round this episode took part in (all live rows' turns, batched)"""

    def observe(self, obs: Observation) -> None:
        self.calls += 1
        self.observation_images.append(obs.images)
        if obs.tool is not None and obs.error is None:
            self.tools[obs.tool] += 1
        if obs.error is not None:
            self.errors[obs.error] += 1
        self.info.update(obs.info)

    def as_dict(self) -> dict[str, Any]:
        return {
            "turns": self.turns, "calls": self.calls, "valid_calls": self.calls - sum(self.errors.values()),
            "errors": dict(self.errors), "tools": dict(self.tools), "stop": self.stop,
            "texts": self.texts, "observations": self.observations, "images": self.images,
            "observation_images": self.observation_images,
            "vision_tokens": self.vision_tokens, "info": self.info,
            "turn_seconds": self.turn_seconds,
        }  # fmt: skip


class Tape:
    """Fixed [B, T] buffers of an episode batch (tokens, loss mask, observation mask, log-probs,
    per-token observation extras) with a write cursor per row, and each row's observation vision
    inputs. Rows are written in place; `to_batch` trims them to the longest row."""

    def __init__(self, rows: int, width: int, pad_id: int, keys: ObservationKeys):
        self.pad_id, self.keys = pad_id, keys
        self.tokens = torch.full((rows, width), pad_id, dtype=torch.long)
        self.mask = torch.zeros((rows, width))
        self.obs = torch.zeros((rows, width))
        self.logp = torch.zeros((rows, width))
        self.node = torch.zeros((rows, width), dtype=torch.long)
        self.extras = {k: torch.zeros((rows, width), dtype=t) for k, t in keys.extras.items()}
        self.cursor = torch.zeros(rows, dtype=torch.long)
        self.observed: list[list[dict[str, Tensor]]] = [[] for _ in range(rows)]
        """each row's observations' vision inputs, in order ({} for a text observation)"""
        self.logs = [EpisodeLog() for _ in range(rows)]

    def _grow(self, width: int) -> None:
        if width <= self.tokens.shape[1]:
            return
        pad = width - self.tokens.shape[1]
        f = torch.nn.functional.pad
        self.tokens = f(self.tokens, (0, pad), value=self.pad_id)
        self.mask, self.obs, self.logp, self.node = (
            f(t, (0, pad)) for t in (self.mask, self.obs, self.logp, self.node)
        )
        self.extras = {k: f(v, (0, pad)) for k, v in self.extras.items()}

    def put_tokens(self, rows: Tensor, tok: Tensor, logp: Tensor | None = None,
                   node: Tensor | None = None) -> None:  # fmt: skip
        """One policy token for each of ``rows`` [L] (``tok``, ``logp`` and the tree ``node``
        of the turn, each [L]) at their cursors."""
        self._grow(int(self.cursor[rows].max()) + 1)
        at = self.cursor[rows]
        self.tokens[rows, at] = tok.cpu()
        self.mask[rows, at] = 1.0
        if logp is not None:
            self.logp[rows, at] = logp.float().cpu()
        if node is not None:
            self.node[rows, at] = node
        self.cursor[rows] += 1

    def copy_rows(self, dst: list[int], src: list[int]) -> None:
        """Rows ``dst`` become copies of rows ``src`` (a fork: the history is shared)."""
        d, s_ = torch.tensor(dst, dtype=torch.long), torch.tensor(src, dtype=torch.long)
        for buf in (self.tokens, self.mask, self.obs, self.logp, self.node, self.cursor,
                    *self.extras.values()):  # fmt: skip
            buf[d] = buf[s_]
        for a, b in zip(dst, src):
            self.observed[a] = list(self.observed[b])
            self.logs[a] = copy.deepcopy(self.logs[b])

    def put_text(self, row: int, ids: list[int], logp: list[float] | None = None,
                 node: int | None = None) -> None:  # fmt: skip
        """A whole policy segment of row ``row`` (forced, e.g. an SFT trace, or sampled by an
        engine that returns whole segments, with their log-probs ``logp`` and tree ``node``)."""
        c, n = int(self.cursor[row]), len(ids)
        self._grow(c + n)
        self.tokens[row, c : c + n] = torch.tensor(ids, dtype=torch.long)
        self.mask[row, c : c + n] = 1.0
        if logp is not None:
            self.logp[row, c : c + n] = torch.tensor(logp, dtype=torch.float32)
        if node is not None:
            self.node[row, c : c + n] = node
        self.cursor[row] += n

    def sequence(self, row: int) -> list[int]:
        """Row ``row``'s tokens so far."""
        return self.tokens[row, : int(self.cursor[row])].tolist()

    def turn_tokens(self, row: int) -> list[int]:
        """Row ``row``'s policy tokens since its last observation."""
        c = int(self.cursor[row])
        n = int(self.mask[row, :c].flip(0).cumprod(0).sum())
        return self.tokens[row, c - n : c].tolist()

    def put_observation(self, row: int, enc: EncodedObservation) -> None:
        """An observation of row ``row`` at its cursor; its segment id is the turn's it answers
        (rows that share the turn share the observation)."""
        c, n = int(self.cursor[row]), int(enc.ids.numel())
        self._grow(c + n)
        self.tokens[row, c : c + n] = enc.ids
        self.obs[row, c : c + n] = 1.0
        self.node[row, c : c + n] = self.node[row, c - 1] if c else 0
        for k, v in enc.extras.items():
            self.extras[k][row, c : c + n] = v
        self.observed[row].append(enc.vision)
        self.cursor[row] += n
        self.logs[row].images += enc.num_images
        self.logs[row].vision_tokens += enc.num_vision_tokens

    def row_sequence(self, row: int) -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]:
        """Row ``row`` so far: ids [C], per-token extras [C], observation vision (concatenated)."""
        c = int(self.cursor[row])
        extras = {k: v[row, :c] for k, v in self.extras.items()}
        keys = {k for v in self.observed[row] for k in v}
        vision = {k: torch.cat([v[k] for v in self.observed[row] if k in v]) for k in keys}
        return self.tokens[row, :c], extras, vision

    def to_batch(self, samples: list[dict], group_id: Tensor, prompts: dict, index: Tensor,
                 with_logp: bool, rows: Tensor | None = None, branches: bool = False,
                 episodes: bool = True) -> RolloutBatch:  # fmt: skip
        """The recorded rows (``rows``, in that order; default all) as a `RolloutBatch` (layout
        in the module docstring) with its segment table (``branches``: the rows of a prompt
        fork, a tree); ``samples``, ``group_id`` and ``index`` (the prompt of each) are per
        returned row. Not ``episodes`` (single-turn rows): no observation inputs, and ``meta``
        holds the sample only."""
        r = torch.arange(len(self.cursor)) if rows is None else rows
        T = max(int(self.cursor[r].max()), 1) if len(r) else 1
        kind = torch.where(self.mask[r, :T] > 0, POLICY, 0)
        kind = torch.where(self.obs[r, :T] > 0, OBSERVATION, kind)
        segments = Segments.from_tokens(self.node[r, :T], kind, index, branches)
        batch = RolloutBatch(
            tokens=self.tokens[r, :T].clone(), mask=self.mask[r, :T].clone(), group_id=group_id,
            logp_rollout=self.logp[r, :T].clone() if with_logp else None, segments=segments,
            prompts=prompts, prompt_index=index, meta=[{"sample": s} for s in samples],
        )  # fmt: skip
        if not episodes:
            return batch
        batch.inputs = {f"obs_{k}": v[r, :T].clone() for k, v in self.extras.items()}
        segments.attach_vision([self.observed[i] for i in r.tolist()])
        for m, log in zip(batch.meta, [self.logs[i] for i in r.tolist()]):
            m.update(completion=log.texts[-1] if log.texts else "",
                     truncated=log.stop in ("turn_length", "max_tokens"), episode=log.as_dict())  # fmt: skip
        return batch


def answer_turn(settings: EpisodeSettings, template: ObservationTemplate, env: EpisodeEnv,
                tape: Tape, row: int, text: str, stopped: str | None,
                banned: list[int]) -> EncodedObservation | None:  # fmt: skip
    """Record policy turn ``text`` of episode ``row`` (its tokens are on ``tape``) and decide
    what follows: the environment's observation, encoded, or the end of the episode with its
    reason in the row's log (an answer, or a budget of ``settings``). ``stopped`` is None when
    the turn ended with the stop token, `STOP_STRING` when it ended at a stop string (answered
    alike, the observation then closes the turn), else why it did not (``turn_length``,
    ``max_tokens``: the episode ends there). Every sampler (HF, vLLM) closes its turns here, so
    budgets and stop reasons mean the same whatever the engine.

    Returns:
        The observation to feed before the next turn, or None when the episode has ended.
    """
    log = tape.logs[row]
    log.texts.append(text)
    log.turns += 1
    if stopped not in ANSWERED:
        log.stop = stopped
        return None
    obs = env.respond(row, text)
    if obs is None:
        log.stop = "answer"
        return None
    enc = None
    if log.turns < settings.max_turns and log.images + len(obs.images) <= settings.max_images:
        enc, obs = template.encode_or_error(obs, banned, stopped == STOP_STRING)
    log.observe(obs)
    log.observations.append(obs.text)
    if log.turns >= settings.max_turns:
        log.stop = "max_turns"
    elif enc is None:
        log.stop = "max_images"
    elif log.vision_tokens + enc.num_vision_tokens > settings.max_vision_tokens:
        log.stop = "max_vision_tokens"
    elif int(tape.cursor[row]) + enc.ids.numel() + 1 > settings.max_tokens:
        log.stop = "max_tokens"
    else:
        return enc
    return None


def stop_string_end(decode: Callable[[list[int]], str], ids: list[int], stops) -> int:
    """How many of a turn's tokens ``ids`` run through the first that completes one of ``stops``
    in the decoded text (``decode``), 0 when none does: where a sampler that checks the stop
    strings after every token ends the turn (an engine that returns whole turns is cut here)."""
    if not stops or not any(s in decode(ids) for s in stops):
        return 0
    return next(n for n in range(1, len(ids) + 1) if any(s in decode(ids[:n]) for s in stops))


def answer_round(settings: EpisodeSettings, template: ObservationTemplate, env: EpisodeEnv,
                 tape: Tape, rows: list[int], texts: list[str], stopped: list[str | None],
                 banned: list[int]) -> list[EncodedObservation | None]:  # fmt: skip
    """`answer_turn` of each of a round's turns (``rows[i]`` wrote ``texts[i]``, not closed
    for reason ``stopped[i]``), after handing the turns it will answer to the environment's
    ``prepare`` where it has one."""
    prepare = getattr(env, "prepare", None)
    if prepare is not None:
        going = [i for i, why in enumerate(stopped) if why in ANSWERED]
        prepare([rows[i] for i in going], [texts[i] for i in going])
    return [
        answer_turn(settings, template, env, tape, row, text, why, banned)
        for row, text, why in zip(rows, texts, stopped)
    ]


def forced_batch(policy, samples: list[dict], traces: list[list[str]]) -> RolloutBatch:
    """Record given policy turns as episodes (SFT targets): each turn is tokenized and ends with
    the stop token (mask 1); after every turn but the last, the policy's episode environment
    answers it (the tool really runs) and its observation is recorded (mask 0).

    Raises:
        ValueError: a turn before the last gets no observation (it calls no tool), or a tool
            call in a trace fails (the trace is wrong, not the policy).
    """
    from . import rollout

    if policy.episode is None:
        raise ValueError("multi-turn SFT traces need rollout.episode.tools or .env")
    prompts, _ = policy.encode(samples, strict=True)
    env = policy.episode.env()
    env.reset([p.sample for p in prompts])
    template = ObservationTemplate(policy.processor, policy.stop_text, policy.episode)
    tape = Tape(len(samples), 64, policy.pad_id, template.keys())
    tok = policy.processor.tokenizer
    prepare = getattr(env, "prepare", None)
    for k in range(max(map(len, traces), default=0)):  # turn by turn, rows side by side
        rows = [row for row, turns in enumerate(traces) if k < len(turns)]
        for row in rows:
            text = traces[row][k]
            tape.put_text(
                row, tok(text, add_special_tokens=False)["input_ids"] + [policy.stop_ids[0]]
            )
            tape.logs[row].texts.append(text)
            tape.logs[row].turns += 1
        going = [row for row in rows if k < len(traces[row]) - 1]
        if prepare is not None and going:
            prepare(going, [traces[row][k] for row in going])
        for row in going:
            obs = env.respond(row, traces[row][k])
            if obs is None or obs.error is not None:
                why = "calls no tool" if obs is None else f"fails: {obs.text}"
                raise ValueError(f"trace of sample {samples[row].get('id')!r}: turn {k + 1} {why}")
            tape.logs[row].observe(obs)
            tape.logs[row].observations.append(obs.text)
            tape.put_observation(row, template.encode(obs, policy.banned_ids))
    for log in tape.logs:
        log.stop = "answer"
    index = torch.arange(len(samples))
    return tape.to_batch(
        [p.sample for p in prompts], index, rollout.prompt_table(prompts), index, False
    )


def episode_context(batch: RolloutBatch) -> RewardContext:
    """The reward context of ``batch``'s episodes: their records (``ctx.episodes``, for a
    reward's episode terms) when every row is an episode (``meta["episode"]``), else none
    (single-turn rows)."""
    records = [m["episode"] for m in batch.meta if "episode" in m]
    return RewardContext(episodes=records if records and len(records) == len(batch) else None)


def episode_metrics(batch: RolloutBatch, prefix: str = "episode") -> dict[str, float]:
    """Metrics of a batch's episodes ({} for single-turn rows): ``<prefix>/turns_mean``,
    ``tool_calls_mean``, ``valid_call_rate``, ``images_mean``, ``obs_tokens_mean``,
    ``stop/<reason>`` (share of episodes), ``tool/calls/<name>`` and ``tool/errors/<name>``
    (counts), and ``time/turn_<k>`` (seconds of the batched round that ran turn k)."""
    logs = [m["episode"] for m in batch.meta if "episode" in m]
    if not logs:
        return {}
    m = summarize(logs, prefix)
    obs = 0.0 if batch.segments is None else float(batch.segments.mask(OBSERVATION).sum())
    m[f"{prefix}/obs_tokens_mean"] = obs / len(logs)
    rounds = max(len(e["turn_seconds"]) for e in logs)
    for k in range(rounds):
        secs = [e["turn_seconds"][k] for e in logs if len(e["turn_seconds"]) > k]
        m[f"time/turn_{k + 1}"] = sum(secs) / len(secs)
    return m


def summarize(logs: list[dict], prefix: str = "episode") -> dict[str, float]:
    """Turns, calls, valid-call rate, images, stop reasons and tool counters of episode records
    (``meta["episode"]``), and the mean of each number an environment put in their ``info``."""
    n = len(logs)
    calls = sum(e["calls"] for e in logs)
    m = {
        f"{prefix}/turns_mean": sum(e["turns"] for e in logs) / n,
        f"{prefix}/tool_calls_mean": calls / n,
        f"{prefix}/valid_call_rate": sum(e["valid_calls"] for e in logs) / max(calls, 1),
        f"{prefix}/images_mean": sum(e["images"] for e in logs) / n,
    }
    for r in STOP_REASONS:
        m[f"{prefix}/stop/{r}"] = sum(e["stop"] == r for e in logs) / n
    tools, errors = Counter(), Counter()
    for e in logs:
        tools.update(e["tools"])
        errors.update(e["errors"])
    numeric = {k for e in logs for k, v in e["info"].items() if isinstance(v, (int, float))}
    for k in sorted(numeric):  # an environment's record, e.g. a planner's planner/progress
        m[k] = sum(float(e["info"].get(k, 0.0)) for e in logs) / n
    m.update({f"tool/calls/{k}": float(v) for k, v in tools.items()})
    m.update({f"tool/errors/{k}": float(v) for k, v in errors.items()})
    return m
