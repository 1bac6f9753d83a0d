import copy
import json
from pathlib import Path

import pytest
import torch

from perceptrl.registry import ADVANTAGES, AGG_MODES, POLICY_LOSSES
from perceptrl.trainer.batch import RolloutBatch
from perceptrl.trainer.checkpoint import list_checkpoints
from perceptrl.trainer.engine import TorchEngine, build_engine
from perceptrl.trainer.loop import Trainer, TrainingDiverged
from perceptrl.trainer.metrics import read_metrics


def _params(policy):
    return {k: v.detach().clone() for k, v in policy.state_dict().items()}


def new_trainer(cfg, policy, source, run_dir, **kw) -> Trainer:
    """A `Trainer` on the recipe's engine, built here as a side's builder builds it."""
    return Trainer(cfg, policy, source, run_dir, engine=build_engine(policy, cfg.train), **kw)


def test_grpo_learns_the_toy_task(toy, tmp_path):
    Policy, Source, config = toy
    torch.manual_seed(0)
    cfg = config(steps=40, lr=0.3)
    policy = Policy()
    new_trainer(cfg, policy, Source(), tmp_path).fit()
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "reward/mean" in r]
    first = sum(r["reward/mean"] for r in rows[:5]) / 5
    last = sum(r["reward/mean"] for r in rows[-5:]) / 5
    assert first < 0.4 and last > 0.8, (first, last)


@pytest.mark.parametrize("adv", ADVANTAGES.names())
@pytest.mark.parametrize("loss", POLICY_LOSSES.names())
def test_every_estimator_and_loss_updates_parameters(toy, tmp_path, adv, loss):
    Policy, Source, config = toy
    torch.manual_seed(1)
    cfg = config(steps=1)
    cfg.algo.adv_estimator, cfg.algo.policy_loss = adv, loss
    cfg.algo.entropy_coef = 0.01
    policy = Policy(value_head="values" in ADVANTAGES.meta(adv)["needs"])
    before = _params(policy)
    trainer = new_trainer(cfg, policy, Source(ragged=True), tmp_path)
    metrics = trainer.train_step()
    after = _params(policy)
    assert not torch.equal(before["logits"], after["logits"]), (
        f"{adv}/{loss} left the policy unchanged"
    )
    assert all(
        v is None or torch.isfinite(torch.tensor(v))
        for v in metrics.values()
        if isinstance(v, float)
    )
    if adv == "gae":
        assert not torch.equal(before["value"], after["value"])
        assert any(k.startswith("critic/") for k in metrics)


@pytest.mark.parametrize("mode", AGG_MODES.names())
def test_micro_batch_accumulation_is_invariant(toy, tmp_path, mode):
    """micro-batch 4 x accumulation 1 == micro-batch 1 x accumulation 4 (same update)."""
    Policy, Source, config = toy
    results = []
    for micro in (4, 1):
        torch.manual_seed(3)
        cfg = config(steps=1, micro_batch_size=micro, minibatch_size=4, grad_clip=0.0)
        cfg.algo.loss_agg_mode = mode
        cfg.algo.kl_coef = 0.0
        policy = Policy()
        with torch.no_grad():
            policy.logits.normal_()
        engine = GradRecordingEngine(policy.parameters(), cfg.train)
        trainer = Trainer(
            cfg, policy, Source(groups=1, group_size=4), tmp_path / f"m{micro}", engine=engine
        )
        trainer.train_step()
        results.append((engine.grads[0], _params(policy)["logits"]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-5, atol=1e-7)
    # Adam turns sub-1e-7 gradient noise into sign flips, so the update is compared loosely
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=cfg.train.lr * 1.01)


class GradRecordingEngine(TorchEngine):
    def __init__(self, params, cfg):
        super().__init__(params, cfg)
        self.grads = []

    def step(self):
        self.grads.append(torch.cat([p.grad.flatten().clone() for p in self.params]))
        return super().step()


class NaNSource:
    def __init__(self, inner):
        self.inner = inner

    def collect(self, policy, step):
        batch, m = self.inner.collect(policy, step)
        batch.rewards = torch.full_like(batch.rewards, float("nan"))
        return batch, m


def test_nonfinite_loss_skips_steps_then_stops(toy, tmp_path):
    Policy, Source, config = toy
    cfg = config(steps=10, max_bad_steps=3)
    policy = Policy()
    before = _params(policy)
    trainer = new_trainer(cfg, policy, NaNSource(Source()), tmp_path)
    with pytest.raises(TrainingDiverged, match="3 consecutive steps.*train.lr"):
        trainer.fit()
    assert torch.equal(before["logits"], _params(policy)["logits"])
    rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "nonfinite/skipped_updates" in r]
    assert len(rows) == 2 and all(r["nonfinite/skipped_updates"] == 1.0 for r in rows)


def _train_metrics(path):
    rows = read_metrics(path)
    return [
        {k: v for k, v in r.items() if not k.startswith(("time/", "sys/"))}
        for r in rows
        if "resumed_from_step" not in r
    ]


def test_resume_reproduces_the_uninterrupted_run(toy, tmp_path):
    Policy, Source, config = toy
    cfg = config(steps=6)
    cfg.checkpoint.every = 2
    cfg.checkpoint.keep_last = 2
    new_trainer(cfg, Policy(), Source(), tmp_path / "full").fit()

    # Interrupted run: trains to step 4 (checkpoint), "dies" after logging step 5 ...
    cut = copy.deepcopy(cfg)
    cut.train.steps = 5
    new_trainer(cut, Policy(), Source(), tmp_path / "cut").fit()
    ckpts = list_checkpoints(tmp_path / "cut" / "checkpoints")
    import shutil

    shutil.rmtree(ckpts[-1])  # the step-5 final checkpoint never made it to disk
    assert list_checkpoints(tmp_path / "cut" / "checkpoints")[-1].name == "step_000004"
    # ... and is resumed with the full step budget from a fresh process state.
    torch.manual_seed(12345)
    new_trainer(cfg, Policy(), Source(), tmp_path / "cut").fit(resume=True)

    full = _train_metrics(tmp_path / "full" / "metrics.jsonl")
    resumed = _train_metrics(tmp_path / "cut" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [r["step"] for r in full]
    for a, b in zip(full, resumed):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-6, abs=1e-7), (a["step"], k)
    assert [p.name for p in list_checkpoints(tmp_path / "cut" / "checkpoints")] == [
        "step_000004",
        "step_000006",
    ]
    state = json.loads(
        (tmp_path / "cut" / "checkpoints" / "step_000006" / "state.json").read_text()
    )
    assert state["step"] == 6


def test_checkpoint_ignores_half_written_temp_dirs(toy, tmp_path):
    Policy, Source, config = toy
    cfg = config(steps=2)
    new_trainer(cfg, Policy(), Source(), tmp_path).fit()
    (tmp_path / "checkpoints" / ".tmp-step_000009-1").mkdir()
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step_000002"]


class ToySFTSource:
    """Targets: every position should be token 3 (``nan_at``: a step whose targets are NaN)."""

    def __init__(self, nan_from: int | None = None):
        self.nan_from = nan_from

    def next_batch(self, step):
        from perceptrl.trainer.batch import RolloutBatch

        B, T = 8, 4
        mask = torch.ones(B, T)
        if self.nan_from is not None and step >= self.nan_from:
            mask = mask * float("nan")
        return RolloutBatch(tokens=torch.full((B, T), 3), mask=mask, group_id=torch.arange(B))


def test_sft_is_an_objective_of_the_trainer(toy, tmp_path):
    Policy, _, config = toy
    cfg = config(steps=30, lr=0.2)
    policy = Policy()
    new_trainer(cfg, policy, ToySFTSource(), tmp_path, objective="sft").fit()
    probs = torch.softmax(policy.logits.detach(), -1)
    assert (probs[:, 3] > 0.9).all()
    losses = [r["sft/loss"] for r in read_metrics(tmp_path / "metrics.jsonl") if "sft/loss" in r]
    assert losses[-1] < 0.1 * losses[0]
    assert list_checkpoints(tmp_path / "checkpoints")[-1].name == "step_000030"
    with pytest.raises(ValueError, match="valid: rl, sft"):
        new_trainer(cfg, policy, ToySFTSource(), tmp_path, objective="dpo")


def test_sft_resumes_exactly_and_stops_on_nonfinite_streaks(toy, tmp_path):
    """What SFT gains from the one trainer: resume (same metrics as an uninterrupted run) and
    the non-finite streak guard."""
    Policy, _, config = toy
    cfg = config(steps=6, lr=0.2)
    cfg.checkpoint.every = 3
    new_trainer(cfg, Policy(), ToySFTSource(), tmp_path / "full", objective="sft").fit()
    cut = copy.deepcopy(cfg)
    cut.train.steps = 3
    new_trainer(cut, Policy(), ToySFTSource(), tmp_path / "cut", objective="sft").fit()
    new_trainer(cfg, Policy(), ToySFTSource(), tmp_path / "cut", objective="sft").fit(resume=True)
    full = _train_metrics(tmp_path / "full" / "metrics.jsonl")
    resumed = _train_metrics(tmp_path / "cut" / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [r["step"] for r in full]
    for a, b in zip(full, resumed):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-7)
    cfg.train.max_bad_steps = 2
    with pytest.raises(TrainingDiverged, match="2 consecutive steps"):
        new_trainer(
            cfg, Policy(), ToySFTSource(nan_from=2), tmp_path / "nan", objective="sft"
        ).fit()


@pytest.mark.parametrize(
    "critic, kl_in_reward, epochs, rollout_logp, acted, expect",
    [
        (False, False, 1, False, False, "own"),  # one on-policy step: its own detached forward
        (True, False, 1, False, False, "score"),  # critic values feed the advantages
        (False, True, 1, False, False, "score"),  # KL folded into the reward reads logp_old
        (False, False, 2, False, False, "score"),  # later epochs need pre-update log-probs
        (False, False, 1, True, False, "score"),  # engine vs trainer gap / TIS
        (True, False, 2, False, True, "source"),  # the collector acted with these parameters
    ],
)
def test_behaviour_source_is_decided_in_one_place(
    toy, tmp_path, critic, kl_in_reward, epochs, rollout_logp, acted, expect
):
    Policy, Source, config = toy
    cfg = config(steps=1, ppo_epochs=epochs)
    cfg.algo.kl_in_reward, cfg.algo.kl_coef = kl_in_reward, 0.1 if kl_in_reward else 0.0
    policy = Policy(value_head=critic)
    ref = Policy() if kl_in_reward else None
    trainer = new_trainer(cfg, policy, Source(), tmp_path, ref_policy=ref)
    batch, _ = trainer.source.collect(policy, 0)
    if rollout_logp:
        batch.logp_rollout = torch.zeros_like(batch.mask)
    if acted:
        batch.logp_old, batch.values_old = (
            torch.zeros_like(batch.mask),
            torch.zeros_like(batch.mask),
        )
    assert trainer.behaviour_source(batch) == expect
    if acted:  # a critic's source must hand over values with the log-probs
        batch.values_old = None
        with pytest.raises(ValueError, match="values_old"):
            trainer.behaviour_source(batch)


def test_whiten_advantages_normalises_over_valid_tokens(toy, tmp_path):
    Policy, Source, config = toy
    cfg = config()
    cfg.algo.adv_estimator, cfg.algo.whiten_advantages = "gae", True
    policy = Policy(value_head=True)
    torch.manual_seed(0)
    trainer = new_trainer(cfg, policy, Source(ragged=True), tmp_path)
    batch, _ = trainer.source.collect(policy, 0)
    batch.rewards = torch.rand_like(batch.mask) * 3 + 5  # per-step rewards far from zero mean
    trainer._score_old(batch)
    trainer._advantages(batch)
    valid = batch.advantages[batch.mask.bool()]
    assert abs(float(valid.mean())) < 1e-5 and abs(float(valid.std()) - 1) < 1e-3
    assert float(batch.advantages[~batch.mask.bool()].abs().max()) == 0.0


class HalfFlatSource:
    """Every other group gets identical rewards (no signal); group ids restart at 0 per collect."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def collect(self, policy, step):
        self.calls += 1
        batch, m = self.inner.collect(policy, step)
        flat = (batch.group_id % 2 == 0).float()
        batch.rewards = batch.rewards * (1 - flat) + flat * 0.5
        return batch, m


def test_dynamic_sampling_refills_the_batch_with_signal_groups(toy, tmp_path):
    Policy, Source, config = toy
    torch.manual_seed(0)
    cfg = config(steps=1)
    cfg.algo.dynamic_sampling, cfg.algo.max_collects = True, 3
    source = HalfFlatSource(Source(groups=4, group_size=4))
    trainer = new_trainer(cfg, Policy(), source, tmp_path)
    batch, metrics = source.collect(trainer.policy, 0)
    out = trainer._filter_groups(batch, metrics)
    assert source.calls == 2 and metrics["dynamic_sampling/collects"] == 2.0
    assert metrics["dynamic_sampling/kept_frac"] == pytest.approx(0.5)
    assert metrics["time/refill"] > 0.0  # the second collection's time is logged
    assert sorted(out.group_id.unique().tolist()) == [0, 1, 2, 3] and len(out) == 16
    for g in range(4):  # every kept group has distinct rewards and its own id
        assert out.rewards[out.group_id == g].std() > 0


def test_dynamic_sampling_gives_up_after_max_collects(toy, tmp_path):
    Policy, Source, config = toy
    cfg = config(steps=1)
    cfg.algo.dynamic_sampling, cfg.algo.max_collects = True, 2

    class Flat(Source):
        def collect(self, policy, step):
            batch, m = super().collect(policy, step)
            batch.rewards = torch.ones_like(batch.rewards)
            return batch, m

    trainer = new_trainer(cfg, Policy(), Flat(), tmp_path)
    metrics = trainer.train_step()
    assert (
        metrics["dynamic_sampling/skipped_step"] == 1.0
        and metrics["dynamic_sampling/collects"] == 2.0
    )


@pytest.mark.parametrize("mode", ["seq-mean-token-sum", "seq-mean-token-mean"])
def test_seq_mean_modes_divide_by_non_empty_rows(toy, tmp_path, mode):
    """An all-padding row (e.g. an episode cut before its first step) changes no gradient."""
    Policy, Source, config = toy
    cfg = config(steps=1, grad_clip=0.0)
    cfg.algo.loss_agg_mode = mode
    torch.manual_seed(0)
    batch, _ = Source(groups=1, group_size=4).collect(Policy(), 0)
    batch.advantages = torch.randn_like(batch.mask) * batch.mask
    batch.logp_old = torch.zeros_like(batch.mask) - 1.6
    padded = RolloutBatch.concat([batch, batch.select([0])])
    padded.mask[-1] = 0.0
    grads = []
    for b in (batch, padded):
        policy = Policy()
        trainer = new_trainer(cfg, policy, Source(), tmp_path / str(len(b)))
        assert trainer._accumulate(b, trainer._loss)[0]
        grads.append(policy.logits.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])


def test_stale_temporaries_are_removed_at_start_and_files_synced_before_rename(
    toy, tmp_path, monkeypatch
):
    """A write killed mid-way leaves ``.tmp-step_*``: the next start (fresh or resumed) removes
    it. Every file of a checkpoint is fsynced before the rename that makes it visible."""
    import os

    from perceptrl.trainer import checkpoint

    Policy, Source, config = toy
    stale = tmp_path / "checkpoints" / ".tmp-step_000003-4242"
    (stale / "model").mkdir(parents=True)
    (stale / "model" / "model.safetensors").write_bytes(b"half")
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(src)))
        real_replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "fsync", fsync)
    monkeypatch.setattr(checkpoint.os, "replace", replace)
    new_trainer(config(steps=1), Policy(), Source(), tmp_path).fit(resume=True)
    assert not stale.exists()
    (ckpt,) = list_checkpoints(tmp_path / "checkpoints")
    renamed = [i for i, (kind, p) in enumerate(events) if kind == "replace" and "checkpoints" in p]
    synced = {Path(p).name for kind, p in events[: renamed[0]] if kind == "fsync"}
    assert {p.name for p in ckpt.rglob("*") if p.is_file()} <= synced


def test_substep_tokens_clip_each_sub_step():
    """Sub-step log-probs [B, T, S] (a flow head's denoising steps): each is a loss token with
    its position's mask and advantage and its own behaviour log-prob."""
    from perceptrl.trainer.batch import substep_tokens
    from perceptrl.trainer.config import AlgoConfig

    mask = torch.tensor([[1.0, 1.0, 0.0]])
    adv = torch.tensor([[1.0, 2.0, 0.0]])
    old = torch.tensor([[[0.0, 0.1], [0.2, 0.3], [0.0, 0.0]]])
    b = RolloutBatch(tokens=torch.zeros(1, 3, 4), mask=mask, group_id=torch.zeros(1),
                     logp_old=old, advantages=adv)  # fmt: skip
    tok = substep_tokens(b, 2)
    assert tok.mask.tolist() == [[1, 1, 1, 1, 0, 0]]
    assert tok.advantages.tolist() == [[1, 1, 2, 2, 0, 0]]
    torch.testing.assert_close(tok.logp_old, old.flatten(1))
    # the second sub-step of position 1 moved far: only its own ratio is clipped (at 1.2)
    new = old.flatten(1) + torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0, 0.0]])
    algo = AlgoConfig(clip_low=0.2, clip_high=0.2)
    loss, m = POLICY_LOSSES.get("ppo_clip")(
        new, tok.logp_old, tok.advantages, tok.mask, algo, num_tokens=tok.mask.sum()
    )
    assert m["clipfrac"] == pytest.approx(0.25)
    assert float(loss) == pytest.approx((-1 - 1 - 2 - 2 * 1.2) / 4, rel=1e-5)


def test_the_cosine_schedule_warms_up_then_decays_to_its_floor():
    """train.lr_schedule=cosine: the optimizer's learning rate over a run of 10 steps with 2
    warm-up steps: linear up to lr, lr at the end of the warm-up, halfway down at the middle of
    the decay, lr * min_lr_ratio at the last step; constant stays at lr after the warm-up."""
    from perceptrl.trainer.config import TrainConfig

    def lrs(**kw) -> list[float]:
        cfg = TrainConfig(steps=10, lr=1.0, warmup_steps=2, **kw)
        engine = TorchEngine([torch.nn.Parameter(torch.zeros(1))], cfg)
        out = []
        for _ in range(11):
            out.append(engine.optimizer.param_groups[0]["lr"])
            engine.step()
        return out

    cosine = lrs(lr_schedule="cosine", min_lr_ratio=0.1)
    assert cosine[:3] == pytest.approx([0.5, 1.0, 1.0])
    assert cosine[6] == pytest.approx(0.1 + 0.9 * 0.5)  # 4 of 8 decay steps done
    assert cosine[10] == pytest.approx(0.1) and cosine == sorted(cosine[:3]) + sorted(
        cosine[3:], reverse=True
    )
    assert lrs()[:3] == pytest.approx([0.5, 1.0, 1.0]) and set(lrs()[1:]) == {1.0}


def test_the_best_evaluation_s_weights_are_kept_whatever_checkpoints_prune(toy, tmp_path):
    """checkpoint.best: the weights of the evaluation with the highest metric (here at step 3
    of 0-5) stay in <run>/best with its record; keep_last prunes the step checkpoints only; a
    resumed run keeps comparing with the kept best, a run started over drops it."""
    from perceptrl.trainer.checkpoint import best_record

    Policy, _, config = toy
    scores = iter([0.2, 0.5, 0.3, 0.7, 0.6, 0.65, 0.68])
    seen = {}

    def evaluator(policy):
        seen[len(seen)] = _params(policy)  # the weights evaluated at step len(seen)
        return {"success_rate": next(scores)}

    cfg = config(steps=5, lr=0.2, eval_every=1)
    cfg.checkpoint.every, cfg.checkpoint.keep_last = 1, 1
    cfg.checkpoint.best = "success_rate"
    policy = Policy()
    new_trainer(cfg, policy, ToySFTSource(), tmp_path, evaluator=evaluator, objective="sft").fit()
    assert best_record(tmp_path) == {"step": 3, "metric": "eval/success_rate", "value": 0.7,
                                     "mode": "max"}  # fmt: skip
    kept = Policy()
    kept.load(tmp_path / "best" / "model")
    torch.testing.assert_close(kept.state_dict()["logits"], seen[3]["logits"], rtol=0, atol=0)
    assert not torch.equal(seen[3]["logits"], seen[5]["logits"])
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step_000005"]

    more = copy.deepcopy(cfg)
    more.train.steps = 6  # resumed: 0.68 at step 6 is below the kept 0.7
    new_trainer(more, Policy(), ToySFTSource(), tmp_path, evaluator=evaluator,
            objective="sft").fit(resume=True)  # fmt: skip
    assert best_record(tmp_path)["step"] == 3
    (tmp_path / ".tmp-best-123").mkdir()  # a write killed mid-way
    again = copy.deepcopy(cfg)
    again.train.steps = 1  # started over: 0.4 at steps 0 and 1 (a tie keeps the first)
    new_trainer(again, Policy(), ToySFTSource(), tmp_path, evaluator=lambda p: {"success_rate": 0.4},
            objective="sft").fit()  # fmt: skip
    assert best_record(tmp_path) == {"step": 0, "metric": "eval/success_rate", "value": 0.4,
                                     "mode": "max"}  # fmt: skip
    assert not list(tmp_path.glob(".tmp-best-*"))

    with pytest.raises(ValueError, match="has no evaluation"):
        new_trainer(cfg, Policy(), ToySFTSource(), tmp_path / "x", objective="sft")
    cfg.checkpoint.best = "eval/accuracy"
    with pytest.raises(ValueError, match="the evaluation has no eval/accuracy; it logs "
                                         "eval/success_rate"):  # fmt: skip
        new_trainer(cfg, Policy(), ToySFTSource(), tmp_path / "y", evaluator=lambda p: {
            "success_rate": 1.0}, objective="sft").fit()  # fmt: skip
