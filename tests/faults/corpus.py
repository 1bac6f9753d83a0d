"""The fault corpus: bad files and damaged run directories, each a case with the answer the
`perceptrl` command owes it.

A case writes its files under a fresh directory and gives the command's arguments; what it
expects is one of

* a named error: the exit status of its class (2 config, 3 data, 4 model, 5 machine, 6 run,
  ``errors.py``) and phrases the one-paragraph message holds;
* a counted skip: status 0 and ``data/skipped_<reason>`` in the run's metrics (lenient data);
* a clean success: status 0 (an awkward file the run reads correctly, a damaged run directory
  it recovers from);

and never a traceback, a hang or a lost file (`tests/faults/test_corpus.py` checks all four).
Kinds: ``config`` (recipes, overrides, arguments), ``data`` (JSONL/JSON/Parquet, images,
videos), ``model`` (``model.path`` and ``--model`` folders), ``machine`` (GPU, directories,
EGL) and ``run`` (run directories to resume).

Run it as a script to write every case into a folder with the command that reproduces it::

    python tests/faults/corpus.py fault_corpus   # then run a printed command from the same folder
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

TINY = [
    "model.path=", "train.steps=1", "data.n_train=8", "data.n_val=2", "rollout.prompts_per_step=2", "rollout.group_size=2",
    "rollout.max_new_tokens=4", "train.eval_samples=0", "train.eval_every=0",
    "checkpoint.every=0", "log.progress=false", "log.tensorboard=false",
    "algo.dynamic_sampling=false",
]  # fmt: skip
"""a one-step VLM run on a freshly built tiny model (well under a second once it is built)"""
GREY = (128, 128, 128)


@dataclass(frozen=True)
class Case:
    """One bad input and the answer owed to it (see the module docstring)."""

    name: str
    kind: str
    """config | data | model | machine | run"""
    make: Callable[[Path], list[str]]
    """writes the case's files under the given (empty) directory; returns the arguments"""
    status: int = 0
    says: tuple[str, ...] = ()
    """phrases the error message (status != 0) or the warnings (status 0) hold"""
    skipped: str | None = None
    """the ``data/skipped_<reason>`` a lenient run counts"""
    slow: bool = False
    env: tuple[tuple[str, str], ...] = ()
    """environment variables of a case that runs in a process of its own"""
    pending: str = ""
    """why the command does not answer this case as it should yet (the test expects it to fail)"""


# ---------------------------------------------------------------------------------------------
# files
# ---------------------------------------------------------------------------------------------


def png(path: Path, size=(56, 56), colour=GREY) -> Path:
    Image.new("RGB", size, colour).save(path)
    return path


IMAGES: dict[str, Callable[[Path], None]] = {
    "truncated.png": lambda p: p.write_bytes(png(p, (64, 64)).read_bytes()[:60]),
    "empty.png": lambda p: p.write_bytes(b""),
    "text.png": lambda p: p.write_text("not an image\n"),
    "strip.png": lambda p: png(p, (3000, 8)),
    "gray16.png": lambda p: Image.fromarray(
        np.linspace(0, 65535, 56 * 56).reshape(56, 56).astype(np.uint16)
    ).save(p),
    "palette.png": lambda p: (
        Image.new("RGB", (56, 56), (200, 40, 40))
        .convert("P", palette=Image.Palette.ADAPTIVE)
        .save(p)
    ),
    "transparent.png": lambda p: Image.new("RGBA", (56, 56), (255, 0, 0, 0)).save(p),
    "gray_alpha.png": lambda p: Image.new("LA", (56, 56), (200, 100)).save(p),
    "bilevel.png": lambda p: Image.new("1", (56, 56), 1).save(p),
    "cmyk.jpg": lambda p: Image.new("CMYK", (56, 56), (0, 100, 100, 0)).save(p),
    "rotated.jpg": lambda p: _exif_rotated(p),
    "tiny.png": lambda p: png(p, (2, 2)),
}
"""file name -> writer of an awkward or broken image"""


def _exif_rotated(path: Path) -> None:
    im = Image.new("RGB", (112, 56), (40, 40, 200))
    exif = im.getexif()
    exif[0x0112] = 6  # shown turned a quarter
    im.save(path, exif=exif.tobytes())


VIDEOS: dict[str, Callable[[Path], None]] = {
    "empty.mp4": lambda p: p.write_bytes(b""),
    "corrupt.mp4": lambda p: p.write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"garbage" * 64),
}

OK = {"image": "ok.png", "question": "How many?", "answer": "2"}


def data_file(root: Path, bad: dict | str | bytes, name: str = "d.jsonl") -> Path:
    """A JSONL file of three good samples with ``bad`` (a record, a raw line, raw bytes) as its
    line 2, beside ``ok.png`` and every image and video of `IMAGES` and `VIDEOS`."""
    png(root / "ok.png")
    for file, write in {**IMAGES, **VIDEOS}.items():
        write(root / file)
    lines = [json.dumps(OK).encode(), _line(bad), json.dumps(OK).encode(), json.dumps(OK).encode()]
    (root / name).write_bytes(b"".join(line + b"\n" for line in lines))
    return root / name


def _line(bad: dict | str | bytes) -> bytes:
    if isinstance(bad, bytes):
        return bad
    return (bad if isinstance(bad, str) else json.dumps(bad)).encode()


def train(root: Path, data: Path, *extra: str) -> list[str]:
    return ["train", "vlm_clevr", f"data.train={data}", *TINY, *extra, "--run-dir", str(root / "r")]


# ---------------------------------------------------------------------------------------------
# data: each bad sample strict (a data error naming line 2) and lenient (a counted skip)
# ---------------------------------------------------------------------------------------------

BAD_SAMPLES: dict[str, tuple[dict | str | bytes, str, str]] = {
    # name: (line 2, reason counted when lenient, phrase of the strict error)
    "malformed json": ('{"image": "ok.png", "question": "How', "malformed", "invalid JSON"),
    "not an object": ("[1, 2, 3]", "malformed", "expected a JSON object"),
    "not utf-8": (b'{"question": "\xff\xfe", "answer": "1"}', "malformed", "not UTF-8"),
    "missing answer": ({"image": "ok.png", "question": "How many?"}, "malformed", "answer"),
    "missing question": ({"image": "ok.png", "answer": "2"}, "malformed", "question"),
    "missing image": ({"question": "How many?", "answer": "2"}, "malformed", "images"),
    "question a number": ({**OK, "question": 7}, "malformed", "'question' must be a string"),
    "answer an object": ({**OK, "answer": {"n": 2}}, "malformed", "'answer' must be a string"),
    "images a number": ({**OK, "image": 3}, "malformed", "path strings"),
    "meta a list": ({**OK, "meta": [1]}, "malformed", "'meta' must be an object"),
    "tools a string": ({**OK, "tools": "zoom"}, "malformed", "'tools' must be a list"),
    "no reward inferable": ({**OK, "answer": "blue"}, "malformed", "no usable reward"),
    "image not found": ({**OK, "image": "nowhere.png"}, "images", "file not found"),
    "image truncated": ({**OK, "image": "truncated.png"}, "images", "truncated.png"),
    "image empty file": ({**OK, "image": "empty.png"}, "images", "empty.png"),
    "image not an image": ({**OK, "image": "text.png"}, "images", "text.png"),
    "image extreme aspect": ({**OK, "image": "strip.png"}, "aspect_ratio", "3000x8 pixels"),
    "special token": ({**OK, "question": "Count <|image_pad|>"}, "special_tokens", "image_pad"),
    "video empty": (
        {"video": "empty.mp4", "question": "When?", "answer": "[1, 2]"}, "videos", "empty",
    ),
    "video corrupt": (
        {"video": "corrupt.mp4", "question": "When?", "answer": "[1, 2]"}, "videos",
        "not a decodable video",
    ),
}  # fmt: skip

GOOD_IMAGES = ("gray16.png", "palette.png", "transparent.png", "gray_alpha.png", "bilevel.png",
               "cmyk.jpg", "rotated.jpg", "tiny.png")  # fmt: skip
"""awkward images a run reads correctly (datasets/images.py): a clean success"""


FAST_RUNS = {"malformed json", "image truncated", "video corrupt", "image extreme aspect",
             "special token", "gray16.png", "transparent.png", "rotated.jpg"}  # fmt: skip
"""the cases that train (lenient skips, awkward images) in the fast lane: one per reason"""


def _data_cases() -> list[Case]:
    out = []
    for name, (bad, reason, phrase) in BAD_SAMPLES.items():
        out.append(Case(f"data/{name}/strict", "data",
                        lambda r, b=bad: train(r, data_file(r, b)), 3, ("d.jsonl", "line 2", phrase,
                        "data.strict=false")))  # fmt: skip
        out.append(Case(f"data/{name}/lenient", "data",
                        lambda r, b=bad: train(r, data_file(r, b), "data.strict=false"),
                        skipped=reason, slow=name not in FAST_RUNS))  # fmt: skip
    for image in GOOD_IMAGES:
        out.append(Case(f"data/{image} reads", "data",
                        lambda r, i=image: train(r, data_file(r, {**OK, "image": i})),
                        slow=image not in FAST_RUNS))  # fmt: skip
    files = {
        "empty file": (lambda r: _raw(r, "d.jsonl", b""), 3, ("the file is empty",)),
        "every line bad": (lambda r: _raw(r, "d.jsonl", b"{\n[]\n"), 3, ("d.jsonl",)),
        "json not a list": (lambda r: _raw(r, "d.json", b'{"a": 1}'), 3, ("list of objects",)),
        "json truncated": (lambda r: _raw(r, "d.json", b'[{"a": 1}, {"b'), 3, ("cannot read",)),
        "parquet corrupt": (lambda r: _raw(r, "d.parquet", b"PAR1garbage"), 3, ("cannot read",)),
        "file missing": (lambda r: r / "nowhere.jsonl", 2, ("data.train=",)),
        "a directory": (lambda r: r, 2, ("data.train=",)),
    }
    for name, (make, status, says) in files.items():
        for mode in ("strict", "lenient"):
            extra = ("data.strict=false",) if mode == "lenient" else ()
            out.append(Case(f"data/{name}/{mode}", "data",
                            lambda r, m=make, e=extra: train(r, m(r), *e), status, says))  # fmt: skip
    return out


def _raw(root: Path, name: str, data: bytes) -> Path:
    (root / name).write_bytes(data)
    return root / name


# ---------------------------------------------------------------------------------------------
# config: recipes, overrides and arguments
# ---------------------------------------------------------------------------------------------


def recipe(root: Path, text: str | bytes, *args: str, command: str = "config") -> list[str]:
    path = root / "recipe.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return [command, str(path), *args]


def _config_cases() -> list[Case]:
    c = lambda name, make, says, status=2: Case(f"config/{name}", "config", make, status, says)  # noqa: E731
    return [
        c("tab indent", lambda r: recipe(r, "side: vlm\nalgo:\n\tkl_coef: 0.1\n"),
          ("recipe.yaml, line 3", "tab", "spaces")),
        c("tab indent, train", lambda r: recipe(r, "algo:\n  kl_coef: 0.1\n\tlr: 1\n",
                                               command="train"), ("line 3", "tab")),
        c("unclosed bracket", lambda r: recipe(r, "algo: {kl_coef: 0.1\ntrain: {}\n"),
          ("recipe.yaml, line", "YAML syntax error")),
        c("unclosed quote", lambda r: recipe(r, 'side: "vlm\n'), ("recipe.yaml", "YAML")),
        c("two colons", lambda r: recipe(r, "algo:\n  kl_coef: a: b\n"), ("line 2",)),
        c("not a mapping", lambda r: recipe(r, "- side\n- vlm\n"), ("mapping",)),
        c("not utf-8", lambda r: recipe(r, b"side: \xff\xfe\n"), ("UTF-8",)),
        c("unknown key", lambda r: recipe(r, "algo:\n  kl_coeff: 0.1\n"), ("did you mean",)),
        c("wrong type", lambda r: recipe(r, "train:\n  steps: many\n"), ("train.steps",)),
        c("bad choice", lambda r: recipe(r, "algo:\n  adv_estimator: grpoo\n"), ("valid",)),
        c("recipe missing", lambda r: ["config", str(r / "nope.yaml")], ("not found",)),
        c("recipe a directory", lambda r: ["config", str(r)], ("directory",)),
        c("override bad yaml", lambda r: ["config", "vlm_clevr", "algo.kl_coef=[1,"],
          ("override 'algo.kl_coef=[1,'", "YAML")),
        c("override bad yaml, train", lambda r: ["train", "vlm_clevr", "rollout.reward={a: 1",
                                                 "--run-dir", str(r / "x")], ("override",)),
        c("override without =", lambda r: ["train", "vlm_clevr", "kl_coef", "--run-dir",
                                           str(r / "x")], ("key.sub=value",)),
        c("override unknown key", lambda r: ["config", "vlm_clevr", "algo.kl_cof=1"],
          ("did you mean 'algo.kl_coef'",)),
        c("eval empty --model", lambda r: ["eval", "vlm_clevr", "--model", "base="],
          ("names no directory",)),
        c("eval --pass-k 0", lambda r: ["eval", "vlm_clevr", "--model", "assets/vlm_base",
                                        "--pass-k", "0", "--out", str(r / "e")], ("positive",)),
        c("run dir is a file", lambda r: ["train", "vlm_clevr", *TINY, "--run-dir",
                                          str(_raw(r, "f", b"x"))], ("is a file",)),
        Case("config/empty recipe", "config", lambda r: recipe(r, "")),  # the defaults
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# model folders, machine
# ---------------------------------------------------------------------------------------------

BASE = Path(__file__).resolve().parents[2] / "assets" / "vlm_base"


def model_dir(root: Path, damage: str) -> Path:
    """A copy of the shipped tiny base with ``damage``."""
    m = root / "model"
    shutil.copytree(BASE, m)
    weights = m / "model.safetensors"
    if damage == "truncated weights":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "no processor":
        for f in ("processor_config.json", "tokenizer.json", "tokenizer_config.json"):
            (m / f).unlink()
    elif damage == "not a model":
        (m / "config.json").write_text('{"model_type": "bert"}')
    elif damage == "config not json":
        (m / "config.json").write_text("{not json")
    elif damage == "no weights":
        weights.unlink()
    elif damage == "empty folder":
        shutil.rmtree(m)
        m.mkdir()
    return m


def _model_cases() -> list[Case]:
    out = []
    for damage, says in {
        "truncated weights": "cut short", "no processor": "processor", "not a model": "not an "
        "image-text-to-text model", "config not json": "config.json", "no weights": "safetensors",
        "empty folder": "no config.json",
    }.items():  # fmt: skip
        out.append(Case(f"model/train, {damage}", "model",
                        lambda r, d=damage: ["train", "vlm_clevr", *TINY[1:],
                                             f"model.path={model_dir(r, d)}", "--run-dir",
                                             str(r / "r")], 4, (says,)))  # fmt: skip
        out.append(Case(f"model/eval, {damage}", "model",
                        lambda r, d=damage: ["eval", "vlm_clevr", "--model", str(model_dir(r, d)),
                                             "--out", str(r / "e")], 4, (says,)))  # fmt: skip
    out += [
        Case("model/train, path missing", "model", lambda r: ["train", "vlm_clevr",
             "model.path=/nowhere/model", "--run-dir", str(r / "r")], 4, ("does not exist",)),
        Case("model/eval, path missing", "model", lambda r: ["eval", "vlm_clevr", "--model",
             "/nowhere/model"], 4, ("no directory",)),
        Case("model/eval vla, a vlm folder", "model", lambda r: ["eval", "vla_ppo_reach_state",
             "--model", str(BASE), "--out", str(r / "e")], 4, ("not a perceptrl VLA policy",)),
        Case("model/eval vla, no checkpoint", "model", lambda r: ["eval", "vla_ppo_reach_state",
             "--model", str(r), "--out", str(r / "e")], 4, ("model.safetensors",)),
    ]  # fmt: skip
    return out


def _machine_cases() -> list[Case]:
    under_file = lambda r: str(_raw(r, "file", b"x") / "run")  # noqa: E731
    return [
        Case("machine/cuda without a GPU", "machine", lambda r: ["train", "vlm_clevr", *TINY,
             "train.device=cuda", "--run-dir", str(r / "r")], 5, ("train.device=cpu",)),
        Case("machine/run dir under a file", "machine", lambda r: ["train", "vlm_clevr", *TINY,
             "--run-dir", under_file(r)], 5, ("cannot create the directory",)),
        Case("machine/log.dir under a file", "machine", lambda r: ["train", "vlm_clevr", *TINY,
             f"log.dir={under_file(r)}"], 5, ("cannot create the directory",)),
        Case("machine/eval --out under a file", "machine", lambda r: ["eval", "vlm_clevr",
             "--model", str(BASE), "--out", under_file(r)], 5, ("cannot create",)),
        *[Case(f"machine/MUJOCO_GL={gl}: {why}", "machine", lambda r: ["train",
               "vla_ppo_reach", "train.steps=1", "env.num_envs=1", "env.image_size=32",
               "log.progress=false", "--run-dir", str(r / "r")], 5, (f"MUJOCO_GL={gl}", "EGL"),
               slow=True, env=(("MUJOCO_GL", gl), ("DISPLAY", "")))
          for gl, why in (("bogus", "unknown"), ("osmesa", "library missing"),
                          ("glx", "no display"))],
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------------
# run directories to resume
# ---------------------------------------------------------------------------------------------

WALL_CLOCK = ("time/", "sys/")


def base_run(cache: Path) -> Path:
    """A finished 3-step VLM run with a checkpoint after every step (made once under ``cache``):
    what the run-directory cases damage, and the metrics a recovered resume must log."""
    run = cache / "_base_run"
    if not (run / "done").exists():
        from perceptrl.cli import main

        shutil.rmtree(run, ignore_errors=True)
        args = [a for a in TINY if not a.startswith(("train.steps", "checkpoint.every"))]
        status = main(["train", "vlm_clevr", *args, "train.steps=3", "checkpoint.every=1",
                       "checkpoint.keep_last=3", "--run-dir", str(run)])  # fmt: skip
        assert status == 0, "the corpus's base run failed"
        (run / "done").write_text("")
    return run


def rows(run: Path) -> list[dict]:
    """metrics.jsonl without wall-clock values and resume markers."""
    from perceptrl.trainer.metrics import read_metrics

    return [{k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)}
            for r in read_metrics(run / "metrics.jsonl") if "resumed_from_step" not in r]  # fmt: skip


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


RUN_DAMAGE: dict[str, Callable[[Path], None]] = {
    "latest weights truncated": lambda run: _cut(_step(run, 3) / "model" / "model.safetensors"),
    "latest trainer state truncated": lambda run: _cut(_step(run, 3) / "trainer_state.pt"),
    "latest state.json empty": lambda run: (_step(run, 3) / "state.json").write_text(""),
    "latest model folder gone": lambda run: shutil.rmtree(_step(run, 3) / "model"),
    "metrics last line cut short": lambda run: _append(run / "metrics.jsonl", b'{"step": 4, "lo'),
    "metrics damaged line inside": lambda run: _append(run / "metrics.jsonl", b"\x00\x00\n"),
    "stale checkpoint write": lambda run: (run / "checkpoints" / ".tmp-step_000004-1").mkdir(),
    "every checkpoint damaged": lambda run: [
        (ckpt / "state.json").write_text("") for ckpt in (run / "checkpoints").glob("step_*")
    ],
    "config.yaml empty": lambda run: (run / "config.yaml").write_text(""),
    "config.yaml syntax error": lambda run: _append(run / "config.yaml", b"algo: {kl_coef: 1\n"),
    "config.yaml tab indent": lambda run: _append(run / "config.yaml", b"extra:\n\tkey: 1\n"),
    "config.yaml missing": lambda run: (run / "config.yaml").unlink(),
}
"""name -> damage done to a copy of the base run before ``perceptrl train --resume``"""
RUN_EXPECT: dict[str, tuple[int, tuple[str, ...]]] = {
    "latest weights truncated": (0, ("damaged checkpoint", "model.safetensors", "cut short")),
    "latest trainer state truncated": (0, ("damaged checkpoint", "trainer_state.pt")),
    "latest state.json empty": (0, ("damaged checkpoint", "state.json")),
    "latest model folder gone": (0, ("damaged checkpoint", "no safetensors")),
    "metrics last line cut short": (0, ("cut short",)),
    "metrics damaged line inside": (0, ("line",)),
    "stale checkpoint write": (0, ()),
    "every checkpoint damaged": (6, ("every checkpoint", "new --run-dir")),
    "config.yaml empty": (6, ("config.yaml is empty",)),
    "config.yaml syntax error": (2, ("config.yaml, line", "YAML")),
    "config.yaml tab indent": (2, ("config.yaml, line", "tab")),
    "config.yaml missing": (2, ("no config.yaml",)),
}
RECOVERED = {"latest weights truncated", "latest trainer state truncated",
             "latest state.json empty", "latest model folder gone"}  # fmt: skip
"""cases resumed from the checkpoint before the damaged one"""


def _step(run: Path, k: int) -> Path:
    return run / "checkpoints" / f"step_{k:06d}"


def _append(path: Path, data: bytes) -> None:
    path.write_bytes(path.read_bytes() + data)


def resume_case(root: Path, damage: str) -> list[str]:
    run = root / "run"
    shutil.copytree(base_run(root.parent), run)
    (run / "done").unlink()
    RUN_DAMAGE[damage](run)
    return ["train", "--resume", str(run)]


FAST_RESUMES = {"latest weights truncated", "latest state.json empty",
                "metrics last line cut short", "every checkpoint damaged", "config.yaml empty",
                "config.yaml tab indent"}  # fmt: skip


def _run_cases() -> list[Case]:
    out = [Case(f"run/{name}", "run", lambda r, d=name: resume_case(r, d), *RUN_EXPECT[name],
                slow=name not in FAST_RESUMES) for name in RUN_DAMAGE]  # fmt: skip
    out.append(Case("run/resume a missing directory", "run",
                    lambda r: ["train", "--resume", str(r / "nowhere")], 2, ("no config.yaml",)))  # fmt: skip
    return out


def _settled_cases() -> list[Case]:
    """Faults the command once answered wrongly (a traceback, or a run that ignored the fault)."""
    run = lambda r, *extra: ["train", "vlm_clevr", *TINY, *extra, "--run-dir", str(r / "r")]  # noqa: E731
    return [
        Case("config/rollout.group_size=0", "config", lambda r: run(r, "rollout.group_size=0"),
             2, ("rollout.group_size",)),
        Case("config/rollout.prompts_per_step=0", "config",
             lambda r: run(r, "rollout.prompts_per_step=0"), 2, ("rollout.prompts_per_step",)),
        Case("data/data.val without data.train", "data",
             lambda r: run(r, f"data.val={data_file(r, OK)}"), 0),
        Case("data/a reward no registry holds/strict", "data",
             lambda r: train(r, data_file(r, {**OK, "reward": "no_such_reward"})), 3,
             ("no_such_reward",)),
        Case("data/an mcq answer that is no option/strict", "data",
             lambda r: train(r, data_file(r, {**OK, "answer": "7", "reward": "mcq"})), 3,
             ("can never score",)),
        Case("data/an inverted box/strict", "data",
             lambda r: train(r, data_file(r, {**OK, "answer": "[30, 30, 10, 10]",
                                               "reward": "iou"})), 3, ("can never score",)),
    ]  # fmt: skip


CASES: list[Case] = [
    *_config_cases(), *_data_cases(), *_model_cases(), *_machine_cases(), *_run_cases(),
    *_settled_cases(),
]  # fmt: skip
"""every case of the corpus, in a fixed order"""


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def main(out: str) -> None:
    """Write every case into ``out/<case>`` and print the command that reproduces it."""
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    for case in CASES:
        here = root / slug(case.name)
        shutil.rmtree(here, ignore_errors=True)
        here.mkdir()
        args = case.make(here)
        env = " ".join(f"{k}={v}" for k, v in case.env)
        want = f"skips {case.skipped}" if case.skipped else f"exit {case.status}"
        want += f" (pending: {case.pending})" if case.pending else ""
        print(f"{case.name}: {want}\n    {env + ' ' if env else ''}perceptrl {shlex.join(args)}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "fault_corpus")
