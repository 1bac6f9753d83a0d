"""The run doctor (trainer/doctor.py): synthetic metric streams with one pathology planted each
and a clean stream; the doctor names exactly the planted ones. Real short runs are in
tests/test_doctor_runs.py."""

from __future__ import annotations

import json

import pytest

from perceptrl.cli import main
from perceptrl.trainer.doctor import diagnose, doctor_paragraph

N = 100


def clean() -> list[dict]:
    """A healthy GRPO run: accuracy and format rise, entropy eases, updates stay small."""
    rows = []
    for s in range(N):
        f = s / (N - 1)
        row = {
            "step": s, "adv/group_zero_std_frac": 0.2 + 0.05 * (s % 3), "actor/entropy": 0.5 - 0.1 * f,
            "actor/clipfrac": 0.05, "actor/approx_kl": 0.005, "actor/kl": 0.01 + 0.04 * f,
            "rollout/clip_ratio": 0.02, "rollout/completion_len_mean": 40.0,
            "reward/accuracy": 0.4 + 0.3 * f, "reward/format": 0.8 + 0.1 * f, "reward/mean": 0.5 + 0.3 * f,
            "nonfinite/skipped_updates": 0.0, "time/refill": 0.1, "time/step": 2.0 + 0.1 * (s % 2),
        }  # fmt: skip
        rows.append(row)
        if s % 10 == 0:
            rows.append({"step": s, "eval/accuracy": 0.4 + 0.3 * f, "time/eval": 5.0})
    return rows


def plant(rows, key, value, start=N // 2, every=1):
    for r in rows:
        if key in r and r["step"] >= start and r["step"] % every == 0:
            r[key] = value(r[key]) if callable(value) else value
    return rows


def drop(rows, prefix):
    return [r for r in rows if not any(k.startswith(prefix) for k in r)]


CASES = {
    "groups scored alike": lambda r: plant(r, "adv/group_zero_std_frac", 0.9),
    "entropy collapse": lambda r: plant(r, "actor/entropy", 0.01),
    "entropy explosion": lambda r: plant(r, "actor/entropy", 3.0),
    "updates too large": lambda r: plant(r, "actor/clipfrac", 0.5),
    "KL to the reference runs away": lambda r: plant(r, "actor/kl", 2.0),
    "completions hit the length limit": lambda r: plant(r, "rollout/clip_ratio", 0.6),
    "a reward component rises while accuracy does not": lambda r: plant(
        plant(drop(r, "eval/"), "reward/accuracy", 0.4, start=0), "reward/format", 1.0
    ),
    "non-finite updates skipped": lambda r: plant(r, "nonfinite/skipped_updates", 1.0, every=4),
    "dynamic-sampling refills dominate the step": lambda r: plant(r, "time/refill", 1.5),
    "samples skipped": lambda r: [{**r[0], "data/skipped_images": 3.0}, *r[1:]],
    "simulator instabilities": lambda r: [
        {**x, "rollout/sim_unstable_frac": 0.05 if x["step"] == 60 else 0.0} for x in r
    ],
    "steps got slower": lambda r: plant(r, "time/step", lambda v: 2 * v),
    "evaluation plateau": lambda r: plant(r, "eval/accuracy", 0.6, start=60),
    "evaluation falls from its best": lambda r: plant(r, "eval/accuracy", lambda v: 0.3, start=70),
}


def test_a_clean_run_has_no_finding():
    assert diagnose(clean()) == []
    assert doctor_paragraph(clean()).startswith("doctor: nothing wrong found (100 logged steps")


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_planted_pathology_is_named_alone(name):
    found = diagnose(CASES[name](clean()))
    assert [f.name for f in found] == [name]
    f = found[0]
    assert f.evidence and f.why and f.fix and f.steps[0] <= f.steps[1]


def test_severity_follows_the_thresholds():
    mild = diagnose(plant(clean(), "adv/group_zero_std_frac", 0.6))
    bad = diagnose(plant(clean(), "adv/group_zero_std_frac", 0.95))
    assert mild[0].severity == "warning" and bad[0].severity == "serious"


def test_the_command_writes_its_report_and_says_serious_by_its_status(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    rows = CASES["KL to the reference runs away"](clean())
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["doctor", str(run)]) == 1
    out = capsys.readouterr().out
    assert "KL to the reference runs away (serious)" in out and "raise algo.kl_coef" in out
    assert (run / "doctor" / "doctor.md").is_file() and (run / "doctor" / "doctor.png").is_file()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in clean()))
    assert main(["doctor", str(run), "--out", str(tmp_path / "d")]) == 0
    assert main(["doctor", str(tmp_path / "missing")]) == 2  # a config error, not a traceback


def test_findings_name_a_recorded_group_that_shows_them():
    """With rollout records, a finding cites the latest recorded group that shows it, inside
    its step range when one is."""
    from perceptrl.trainer.doctor import Finding, with_examples

    def group(gid, rewards, cut=False):
        rows = [{"reward": r, "truncated": cut, "text": f"answer {r}"} for r in rewards]
        return {"group": gid, "id": f"s{gid}", "rows": rows}

    records = [
        {"step": 1, "groups": [group(0, [0, 0]), group(1, [0, 1])]},
        {"step": 5, "groups": [group(2, [1, 1], cut=True), group(3, [1, 0])]},
        {"step": 9, "groups": [group(4, [0, 1])]},
    ]
    alike = Finding("groups scored alike", "serious", (1, 5), "", "", "")
    cut = Finding("completions hit the length limit", "serious", (7, 9), "", "", "")
    other = Finding("entropy collapse", "warning", (1, 9), "", "", "")
    with_examples([alike, cut, other], records)
    assert alike.example == "step 5, group 2 (s2): rewards 1 1; a sample: 'answer 1'"
    assert cut.example.startswith("step 5, group 2")  # none inside 7-9: the latest outside
    assert other.example == ""


def test_an_off_policy_warm_up_is_not_a_slowdown():
    """Steps of random actions before learning starts take no updates: not the run's pace."""
    rows = [{"step": s, "time/step": 0.02, "replay/random_actions": 1.0} for s in range(1, 11)]
    rows += [{"step": s, "time/step": 0.8, "replay/random_actions": 0.0} for s in range(11, 41)]
    assert "steps got slower" not in {f.name for f in diagnose(rows)}
    slow = [dict(r, **{"time/step": 3.0}) for r in rows[-10:]]
    assert "steps got slower" in {f.name for f in diagnose(rows[:-10] + slow)}
