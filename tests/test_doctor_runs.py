"""The run doctor on real short runs: a run whose reward cannot be reached and one whose
sampling has collapsed are diagnosed for what happened; a healthy one gets nothing serious, and
`perceptrl train` ends with the doctor's paragraph."""

from __future__ import annotations

import pytest

from perceptrl.cli import main
from perceptrl.trainer.doctor import diagnose
from perceptrl.trainer.metrics import read_metrics

QUIET = ["log.progress=false", "log.tensorboard=false", "checkpoint.every=0"]
VLM = [
    "data.n_train=12", "data.n_val=4", "rollout.prompts_per_step=2", "rollout.group_size=4",
    "train.micro_batch_size=8", "train.eval_samples=4", "train.eval_every=0",
    "algo.dynamic_sampling=false", "train.steps=6",
]  # fmt: skip


def run(tmp_path, capsys, *overrides: str) -> tuple[set[str], dict, str]:
    d = tmp_path / "run"
    assert main(["train", "vlm_clevr", *QUIET, *VLM, *overrides, "--run-dir", str(d)]) == 0
    found = diagnose(read_metrics(d / "metrics.jsonl"))
    return {f.name for f in found}, {f.name: f.severity for f in found}, capsys.readouterr().out


def test_an_unreachable_reward(tmp_path, capsys):
    # two tokens can hold no answer: every completion is cut and every group scores 0
    names, severity, out = run(tmp_path, capsys, "rollout.max_new_tokens=2",
                               "rollout.reward={accuracy: 1.0}")  # fmt: skip
    assert severity["groups scored alike"] == "serious"
    assert severity["completions hit the length limit"] == "serious"
    assert "doctor: " in out and "groups scored alike" in out


def test_collapsed_sampling(tmp_path, capsys):
    # a temperature near 0 samples the same completion G times: no group disagrees
    names, severity, _ = run(tmp_path, capsys, "rollout.temperature=0.01",
                             "rollout.max_new_tokens=48")  # fmt: skip
    assert severity["groups scored alike"] == "serious"


@pytest.mark.slow
def test_a_healthy_run_has_nothing_serious(tmp_path, capsys):
    names, severity, out = run(tmp_path, capsys, "rollout.max_new_tokens=48", "train.steps=12")
    assert "serious" not in severity.values(), severity
