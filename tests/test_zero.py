"""DeepSpeed ZeRO backend: 2-rank ZeRO-2/3 runs (torchrun, gloo, CPU) against one process.

Stated tolerance: per-step ``actor/pg_loss`` and ``actor/entropy`` within 1e-4 absolute, the
gradient norm within 1e-3 relative, final weights within 1e-4 (fp32; only the order of the
reductions differs across ranks; measured agreement is about 1e-7). The multi-process tests
launch subprocesses (~10-20 s each on 2 shared cores) and are marked slow: run them with
``make test-zero``. The fast ones check the seam in one process.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from perceptrl.trainer.checkpoint import load_trainer_state
from perceptrl.trainer.config import TrainConfig
from perceptrl.trainer.deepspeed_engine import (
    DeepSpeedEngine,
    UnsafeCheckpointError,
    ds_config,
    policy_module,
    weights_only_torch_load,
)
from perceptrl.trainer.engine import TorchEngine, build_engine
from perceptrl.wiring import Config, load_config

WORKER = Path(__file__).resolve().parent / "zero_worker.py"
REPO = Path(__file__).resolve().parents[1]
LOSS_TOL, NORM_RTOL, WEIGHT_TOL = 1e-4, 1e-3, 1e-4


def _env() -> dict:
    # the CPU path (gloo, fp32) even on a machine with GPUs
    env = dict(
        os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", DS_ACCELERATOR="cpu"
    )
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def _run(cmd: list[str], log: Path, timeout: int = 300) -> None:
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(), timeout=timeout)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        raise AssertionError(f"{' '.join(map(str, cmd))} failed ({proc.returncode}):\n{tail}")


def _torchrun(n: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]


def _worker(out: Path, model: Path, *extra, nproc: int = 1) -> Path:
    base = _torchrun(nproc) if nproc > 1 else [sys.executable]
    _run(
        [*base, str(WORKER), "--model", str(model), "--out", str(out), *extra],
        out.with_suffix(".log"),
    )
    return out


def _steps(run: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "actor/pg_loss" in r}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from perceptrl.vlm.tiny import build_tiny

    return build_tiny("qwen2_5_vl", tmp_path_factory.mktemp("zero") / "tiny", seed=0)


@pytest.fixture(scope="module")
def single(tiny, tmp_path_factory) -> Path:
    """The reference: one process, torch engine, the full global batch."""
    out = tmp_path_factory.mktemp("single") / "run"
    return _worker(out, tiny, "--backend", "torch")


@pytest.fixture(scope="module")
def zero2(tiny, tmp_path_factory) -> Path:
    """2 ranks, ZeRO-2, a checkpoint every 2 steps."""
    out = tmp_path_factory.mktemp("zero2") / "run"
    return _worker(out, tiny, "--stage", "2", "--ckpt-every", "2", nproc=2)


@pytest.fixture(scope="module")
def zero3(tiny, tmp_path_factory) -> Path:
    """2 ranks, ZeRO-3, a checkpoint every 2 steps."""
    out = tmp_path_factory.mktemp("zero3") / "run"
    return _worker(out, tiny, "--stage", "3", "--ckpt-every", "2", nproc=2)


def _assert_same_trajectory(ref: Path, run: Path, tiny: Path) -> None:
    a, b = _steps(ref), _steps(run)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    for s in a:
        for key in ("actor/pg_loss", "actor/entropy", "reward/mean", "adv/abs_mean"):
            assert abs(a[s][key] - b[s][key]) < LOSS_TOL, (s, key, a[s][key], b[s][key])
        assert b[s]["grad_norm"] == pytest.approx(a[s]["grad_norm"], rel=NORM_RTOL)
    wa = load_file(str(ref / "final_state.safetensors"))
    wb = load_file(str(run / "final_state.safetensors"))
    assert wa.keys() == wb.keys()
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < WEIGHT_TOL
    # the weights moved: the comparison is not between two untrained models
    from transformers import AutoModelForImageTextToText

    init = AutoModelForImageTextToText.from_pretrained(tiny, local_files_only=True).state_dict()
    moved = max((wa[k] - init[k]).abs().max().item() for k in wa)
    assert moved > 10 * WEIGHT_TOL


@pytest.mark.slow
def test_zero2_two_ranks_match_single_process(tiny, single, zero2):
    _assert_same_trajectory(single, zero2, tiny)


@pytest.mark.slow
def test_zero3_two_ranks_match_single_process_and_sample(tiny, single, zero3):
    _assert_same_trajectory(single, zero3, tiny)
    # every rank sampled its own prompts with gathered weights, stopping at different lengths
    assert json.loads((zero3 / "rollout.json").read_text())["generated_tokens"] > 0


@pytest.fixture(scope="module")
def single_nan(tiny, tmp_path_factory) -> Path:
    """One process with NaN rewards at step 2: that step's update is skipped."""
    out = tmp_path_factory.mktemp("single_nan") / "run"
    return _worker(out, tiny, "--backend", "torch", "--nan-step", "1")


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_skipped_minibatch_leaves_no_gradient_behind(tiny, single_nan, tmp_path, stage):
    """A NaN loss in a rank's second micro-batch skips the minibatch after its first micro-batch
    ran backward; those gradients must not leak into the next update (as in one process)."""
    run = _worker(tmp_path / "run", tiny, "--stage", str(stage), "--nan-step", "1", nproc=2)
    a, b = _steps(single_nan), _steps(run)
    assert sorted(a) == sorted(b) == [1, 3, 4]  # step 2 made no update and logs no loss
    for s in (3, 4):
        assert abs(a[s]["actor/pg_loss"] - b[s]["actor/pg_loss"]) < LOSS_TOL
        assert b[s]["grad_norm"] == pytest.approx(a[s]["grad_norm"], rel=NORM_RTOL)
    wa = load_file(str(single_nan / "final_state.safetensors"))
    wb = load_file(str(run / "final_state.safetensors"))
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < WEIGHT_TOL


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_checkpoint_resume_gives_the_same_next_losses(tiny, request, tmp_path, stage):
    """Resuming (DeepSpeed's files read with weights_only=True) continues bit for bit."""
    run = request.getfixturevalue(f"zero{stage}")
    step2 = run / "checkpoints" / "step_000002"
    assert (step2 / "zero").is_dir() and (step2 / "trainer_state.rank1.pt").is_file()
    assert load_trainer_state(step2, rank=1)[0]["engine"]["zero_stage"] == stage
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000004")
    _worker(resumed, tiny, "--stage", str(stage), "--ckpt-every", "2", "--resume", nproc=2)
    a, b = _steps(run), _steps(resumed)
    for s in (3, 4):
        assert b[s]["actor/pg_loss"] == pytest.approx(a[s]["actor/pg_loss"], abs=1e-6)
        assert b[s]["grad_norm"] == pytest.approx(a[s]["grad_norm"], rel=1e-5)
    wa = load_file(str(run / "final_state.safetensors"))
    wb = load_file(str(resumed / "final_state.safetensors"))
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-6


class _Payload:
    """What a malicious checkpoint would hold: unpickling it runs ``touch <marker>``."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(self.marker)}",))


def _pickled_globals(path: Path) -> set[tuple[str, str]]:
    """(module, name) of every global a torch.save file's pickle refers to, read without
    unpickling it."""
    import pickletools
    import zipfile

    with zipfile.ZipFile(path) as z:
        data = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    found, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
            found.add((strings[-2], strings[-1]))
        elif op.name == "GLOBAL":
            found.add(tuple(arg.split(" ", 1)))
    return found


def _tamper(path: Path, marker: Path) -> None:
    """Add a payload to a DeepSpeed state file, keeping everything else in it."""
    with weights_only_torch_load():
        state = torch.load(path, map_location="cpu", weights_only=True)
    state["extra"] = _Payload(marker)
    torch.save(state, path)


@pytest.mark.slow
def test_zero3_resume_refuses_a_tampered_checkpoint(tiny, zero3, tmp_path):
    """A pickled object injected into rank 1's ZeRO file stops the resume with a message naming
    the file, and the object's code never runs (on any rank)."""
    resumed, marker = tmp_path / "tampered", tmp_path / "payload_ran"
    shutil.copytree(zero3, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000004")
    bad = resumed / "checkpoints/step_000002/zero/state/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    _tamper(bad, marker)
    with pytest.raises(AssertionError, match="failed"):
        _worker(resumed, tiny, "--stage", "3", "--ckpt-every", "2", "--resume", nproc=2)
    log = resumed.with_suffix(".log").read_text()
    assert f"refusing to load {bad}: it holds a pickled posix.system object" in log
    assert "model.path=<checkpoint>/model" in log
    assert not marker.exists()
    assert not (resumed / "checkpoints" / "step_000004").exists()  # it never trained on


@pytest.mark.slow
def test_zero3_export_is_the_consolidated_trained_weights(zero3):
    from transformers import AutoModelForImageTextToText

    export = zero3 / "checkpoints" / "step_000004" / "model"
    model = AutoModelForImageTextToText.from_pretrained(export, local_files_only=True)
    live = load_file(str(zero3 / "final_state.safetensors"))  # gathered after training
    state = model.state_dict()
    assert set(live) <= set(state)
    for k, v in live.items():
        assert torch.equal(state[k], v), k  # whole tensors, not rank 0's partition


@pytest.mark.slow
def test_cli_train_under_torchrun_zero3_lora_with_rollouts(tmp_path):
    """`perceptrl train` as 2 ranks: sampled rollouts and evaluation under ZeRO-3 (gathered
    weights), LoRA with the adapter-disabled reference for the KL, checkpoints, export."""
    run = tmp_path / "cli"
    overrides = [
        "train.backend=deepspeed", "train.zero_stage=3", "train.steps=2", "train.lr=1e-3",
        "algo.dynamic_sampling=false", "algo.kl_coef=0.05", "data.n_train=16", "data.n_val=4",
        "train.eval_samples=4", "rollout.prompts_per_step=4", "rollout.group_size=2",
        "rollout.max_new_tokens=12", "train.micro_batch_size=2", "model.lora_rank=4",
        "log.progress=false", "log.tensorboard=false",
        "algo.dynamic_sampling=false",  # refused with several ranks (see trainer/loop.py)
    ]  # fmt: skip
    cmd = [*_torchrun(2), "-m", "perceptrl.cli", "train", "vlm_clevr", "--run-dir", str(run)]
    _run([*cmd, *overrides], tmp_path / "cli.log")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "actor/pg_loss" in r] == [1, 2]
    assert any("eval/accuracy" in r for r in rows)
    model = run / "checkpoints" / "step_000002" / "model"
    # exports hold whole tensors (gathered), not ZeRO-3's empty local placeholders
    adapter = load_file(str(model / "adapter" / "adapter_model.safetensors"))
    assert adapter and all(t.dim() == 2 and t.shape[0] * t.shape[1] > 0 for t in adapter.values())
    assert {min(t.shape) for t in adapter.values()} == {4}  # lora_rank
    from transformers import AutoModelForImageTextToText

    merged = AutoModelForImageTextToText.from_pretrained(model, local_files_only=True)
    assert not any(".lora_" in n for n, _ in merged.named_parameters())
    assert load_config(run / "config.yaml").train.zero_stage == 3


# ---- one process: the seam ---------------------------------------------------------------------


def test_ds_config_follows_train_config():
    cfg = TrainConfig(backend="deepspeed", zero_stage=3, grad_clip=0.5, micro_batch_size=4)
    ds = ds_config(cfg, bf16=False)
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"]
    assert ds["gradient_clipping"] == 0.5 and ds["bf16"]["enabled"] is False
    assert ds["managed_gradient_accumulation"] is False  # the loop owns accumulation
    assert ds_config(TrainConfig(grad_clip=0.0), bf16=True)["bf16"]["enabled"]


def test_build_engine_backends_and_errors():
    module = torch.nn.Linear(3, 2)
    assert isinstance(build_engine(module, TrainConfig()), TorchEngine)
    with pytest.raises(ValueError, match="valid: deepspeed, torch"):
        build_engine(module, TrainConfig(backend="fsdp"))
    with pytest.raises(ValueError, match="ZeRO 2 or 3"):
        DeepSpeedEngine(module, TrainConfig(backend="deepspeed", zero_stage=1))
    with pytest.raises(TypeError, match="no nn.Module"):
        policy_module(object())


def test_torch_engine_seam_is_identity_and_rejects_deepspeed_state():
    engine = TorchEngine(torch.nn.Linear(3, 2).parameters(), TrainConfig())
    assert engine.world_size == 1 and engine.is_main
    assert float(engine.all_reduce_sum(torch.tensor(3.0))) == 3.0
    assert engine.all_true(True) and not engine.all_true(False)
    with engine.rollout_context():
        pass
    with pytest.raises(ValueError, match="deepspeed backend"):
        engine.restore(
            Path("ckpt"), {"backend": "deepspeed", "zero_stage": 2, "world_size": 2}, None
        )


def test_weights_only_torch_load_reads_deepspeed_state_and_refuses_other_objects(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    original = torch.load
    ok = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    optim = {
        "loss_scaler": LossScaler(1.0),
        "zero_stage": ZeroStageEnum.weights,
        "fp32": [torch.arange(3.0)],
        "param_slice_mappings": [{"w": fragment_address(numel=3, start=0)}],
    }
    state = {
        "optimizer_state_dict": optim,
        "param_shapes": [{"w": torch.Size([3])}],
        "ds_version": "0.19.8",
    }
    torch.save(state, ok)
    with weights_only_torch_load():
        got = torch.load(ok, map_location="cpu", weights_only=False)  # DeepSpeed's call
    assert got["optimizer_state_dict"]["zero_stage"] is ZeroStageEnum.weights
    assert got["optimizer_state_dict"]["loss_scaler"].cur_scale == 1.0
    assert torch.equal(got["optimizer_state_dict"]["fp32"][0], torch.arange(3.0))
    assert got["optimizer_state_dict"]["param_slice_mappings"][0]["w"].numel == 3
    assert torch.load is original  # restored on exit

    marker = tmp_path / "payload_ran"
    _tamper(ok, marker)
    refused = "refusing to load .*optim_states.pt: it holds a pickled posix.system object"
    with pytest.raises(UnsafeCheckpointError, match=refused):
        with weights_only_torch_load():
            torch.load(ok, map_location="cpu", weights_only=False)
    assert not marker.exists() and torch.load is original
    assert ("posix", "system") in _pickled_globals(ok)  # the payload is there: a load would run it


def test_config_fields_and_data_shard():
    from perceptrl.vlm.builder import data_shard

    cfg = load_config(
        None, ["train.backend=deepspeed", "train.zero_stage=3", "rollout.prompts_per_step=6"]
    )
    assert (cfg.train.backend, cfg.train.zero_stage) == ("deepspeed", 3)
    samples = [{"id": i} for i in range(7)]
    train, rollout, seed = data_shard(samples, cfg.rollout, cfg.train.seed, 1, 2)
    assert [s["id"] for s in train] == [1, 3, 5] and rollout.prompts_per_step == 3
    assert seed != cfg.train.seed and cfg.rollout.prompts_per_step == 6  # not mutated
    one = data_shard(samples, cfg.rollout, cfg.train.seed, 0, 1)
    assert one == (samples, cfg.rollout, cfg.train.seed)
    from perceptrl.trainer.config import ConfigError

    with pytest.raises(ConfigError, match="multiple of the number of processes"):
        data_shard(samples, cfg.rollout, cfg.train.seed, 0, 4)


def test_trainer_rejects_dynamic_sampling_across_ranks(tmp_path):
    from perceptrl.trainer.loop import Trainer

    class TwoRanks(TorchEngine):
        world_size = 2

    cfg = Config()
    cfg.algo.dynamic_sampling = True
    module = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="dynamic_sampling"):
        Trainer(cfg, module, None, tmp_path, engine=TwoRanks(module.parameters(), cfg.train))


def test_an_error_on_rank0_stops_every_rank(tmp_path):
    """``on_rank0`` (rank 0 loads or generates the data): when it raises, every rank raises the
    same error instead of waiting forever for rank 0's result."""
    script = tmp_path / "rank0_error.py"
    script.write_text(
        "import sys\n"
        "from perceptrl.trainer.distributed import (\n"
        "    on_rank0, rank_and_world, shutdown_distributed)\n"
        "def load():\n"
        "    raise ValueError('data file empty: x.jsonl')\n"
        "try:\n"
        "    on_rank0(load)\n"
        "except ValueError as e:\n"
        "    print(f'rank {rank_and_world()[0]} raised: {e}', flush=True)\n"
        "    shutdown_distributed(barrier=False)  # as the CLI does on every exit path\n"
        "    sys.exit(0)\n"
        "sys.exit(1)\n"
    )
    log = tmp_path / "rank0_error.log"
    _run([*_torchrun(2), str(script)], log, timeout=120)
    text = log.read_text()
    assert "rank 0 raised: data file empty" in text and "rank 1 raised: data file empty" in text
