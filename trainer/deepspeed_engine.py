"""DeepSpeed ZeRO (stage 2 or 3) engine behind the same seam as `TorchEngine`
(``trainer.engine.Engine``), registered as ``train.backend=deepspeed``; the process group it
joins is managed by trainer/distributed.py.

Launch with ``torchrun --nproc_per_node N`` or ``deepspeed --num_gpus N`` (multi-node: a
hostfile, see docs/launch.md). Every rank runs the whole loop on its own share of the prompts;
the loop all-reduces the token/sequence counts that normalise the loss, so each rank's loss is
its share of the *global* minibatch loss and N ranks × B/N samples give the gradient that one
process gives on B samples. DeepSpeed averages gradients over ranks, so ``backward`` scales the
loss by the world size to turn that average back into the sum the global normalisers call for.

Precision: bf16 weights and activations with fp32 master weights on a GPU; plain fp32 on the CPU
(DeepSpeed's CPU accelerator, gloo collectives), where the tests run it with two processes.

ZeRO-3 partitions the parameters: a forward gathers each layer's weights on the fly, which is a
collective every rank must join. Token-by-token sampling runs a different number of forwards
per rank, so rollouts and evaluation run inside ``rollout_context()``, which gathers the full
weights once on every rank and removes the gathering hooks until it exits (DeepSpeed's
``unwrap_model_for_generation``): generation memory is that of the full model.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import pickle
import re
from pathlib import Path

import torch
from torch import Tensor, nn

from ..errors import RunError
from ..registry import ENGINES
from .config import TrainConfig
from .distributed import init_distributed, rank_and_world
from .optim import adamw

ZERO_DIR = "zero"
"""sub-directory of a checkpoint with DeepSpeed's own per-rank files (optimizer and, under
ZeRO-3, parameter partitions); ``zero_to_fp32.py`` in it consolidates them offline"""

SAFE_DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
"""The only classes resuming unpickles from DeepSpeed's files, all plain data: the ZeRO
optimizer state stores its static loss scaler (a scale and a flag) and its ZeRO stage (an enum),
and ZeRO-2's its parameter slice map (``fragment_address``: numel, start). Measured with
deepspeed 0.19.8, ZeRO-2 and ZeRO-3, fp32 on the CPU; everything else in the files is tensors,
OrderedDicts, containers, numbers and strings."""


class UnsafeCheckpointError(RunError, ValueError):
    """A checkpoint file holds a pickled object that resuming refuses to load (loading it could
    run arbitrary code)."""


def _refusal(f, err: Exception) -> str:
    found = re.search(r"GLOBAL (\S+)", str(err))
    what = f"a pickled {found.group(1)} object" if found else "pickled data that is not tensors"
    return (
        f"refusing to load {f}: it holds {what}. Resuming loads DeepSpeed's files with "
        "torch.load(weights_only=True): tensors, containers, numbers, strings and "
        f"{', '.join(n.rsplit('.', 1)[1] for n in SAFE_DEEPSPEED_GLOBALS)} only, so this file was "
        "not written by this project's DeepSpeed engine or was altered since. Resume from a "
        "checkpoint your run wrote, or start a new run from the consolidated weights "
        "(model.path=<checkpoint>/model). If a newer DeepSpeed stores another class, check it and "
        "add it to SAFE_DEEPSPEED_GLOBALS in trainer/deepspeed_engine.py."
    )


@contextlib.contextmanager
def weights_only_torch_load(allowed: tuple[str, ...] = SAFE_DEEPSPEED_GLOBALS):
    """Within the block every ``torch.load`` runs with ``weights_only=True`` and the classes named
    in ``allowed`` ("module.Class") allow-listed, whatever its caller passes (DeepSpeed's loaders
    pass ``weights_only=False``), so no file read inside can execute pickled code.

    Raises (from a load inside the block):
        UnsafeCheckpointError: a file holds any other pickled object; it names the file and what
            to do, and nothing of the file was run.
    """
    classes = []
    for name in allowed:
        module, _, attr = name.rpartition(".")
        classes.append(getattr(importlib.import_module(module), attr))
    original = torch.load

    def load(f, *args, **kwargs):
        kwargs["weights_only"] = True
        try:
            with torch.serialization.safe_globals(classes):
                return original(f, *args, **kwargs)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(_refusal(f, e)) from None

    torch.load = load  # DeepSpeed calls torch.load by attribute, at call time
    try:
        yield
    finally:
        torch.load = original


def ds_config(cfg: TrainConfig, bf16: bool) -> dict:
    """The DeepSpeed config of a run: ZeRO ``train.zero_stage``, no managed gradient
    accumulation (the loop calls ``backward`` per micro-batch and ``step`` once per minibatch),
    clipping by ``train.grad_clip``."""
    zero: dict = {"stage": cfg.zero_stage, "contiguous_gradients": True, "overlap_comm": False}
    if cfg.zero_stage == 3:
        # consolidated 16-bit (bf16 on GPU, fp32 on CPU: the module's dtype) weights on save
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": cfg.grad_clip if cfg.grad_clip > 0 else 0.0,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "zero_allow_untested_optimizer": True,  # torch AdamW: the same optimizer as TorchEngine
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


class DeepSpeedEngine:
    """ZeRO-2/3 engine with `TorchEngine`'s methods (backward, step, zero_grad, lr, state).

    Args:
        module: the policy's ``nn.Module`` (``policy.model`` for a VLM); DeepSpeed partitions its
            parameters in place, so the policy keeps calling the same module.
        cfg: ``train.*`` (lr, weight decay, warm-up, clipping, ``zero_stage``, device).
    """

    def __init__(self, module: nn.Module, cfg: TrainConfig):
        import deepspeed

        if cfg.zero_stage not in (2, 3):
            raise ValueError(
                f"train.zero_stage={cfg.zero_stage}: DeepSpeed backend runs ZeRO 2 or 3"
            )
        init_distributed()
        self.rank, self.world_size = rank_and_world()
        self.cfg = cfg
        self.module = module
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the policy has no trainable parameters (all requires_grad=False)")
        on_gpu = next(module.parameters()).device.type == "cuda"
        self.bf16 = on_gpu
        optimizer, scheduler = adamw(params, cfg)
        self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=module, optimizer=optimizer, lr_scheduler=scheduler,
            config=ds_config(cfg, bf16=self.bf16),
        )  # fmt: skip

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def zero_stage(self) -> int:
        return self.cfg.zero_stage

    # ---- the loop's seam ------------------------------------------------------------------------

    def backward(self, loss: Tensor) -> None:
        # DeepSpeed averages gradients over ranks; the loss is this rank's share of a global sum
        self.ds.backward(loss * self.world_size, scale_wrt_gas=False)
        # The policy calls the module, not ``self.ds.forward``, which would do this at the start
        # of the next forward: without it ZeRO-3 overwrites, rather than adds, the gradient
        # partitions of the previous micro-batch (measured: with two micro-batches per rank the
        # 2-rank run's gradient norm was 1.85 where one process had 2.84).
        self.ds.optimizer.clear_backward_seen_flag()

    def zero_grad(self) -> None:
        """Drop the gradients accumulated since the last step (the loop calls this when it skips
        a minibatch whose loss was not finite). Backward has already reduced earlier micro-
        batches into DeepSpeed's partitions, so those go too, as DeepSpeed's own overflow path
        drops them: ZeRO-3 restarts its accumulation (``micro_step_id = 0``: the next backward
        overwrites the partitions); ZeRO-2 clears its accumulated partition tensors."""
        self.ds.zero_grad()
        opt = self.ds.optimizer
        opt.zero_grad(set_to_none=True)
        if self.cfg.zero_stage == 2:
            if hasattr(opt, "_release_preflattened_grad_buffers"):
                opt._release_preflattened_grad_buffers()
            for store in (opt.averaged_gradients, opt.all_grad_tensors):
                for k in list(store):
                    store[k] = None

    def step(self) -> tuple[float, bool]:
        """Reduce, clip and apply the accumulated gradients on every rank.

        Returns:
            (grad_norm, stepped): the pre-clip global norm, and False when it was not finite
            (the update is then skipped by DeepSpeed's own overflow check or, failing that, the
            weights are not trusted and the caller counts a bad step).
        """
        self.ds.step()
        norm = self.ds.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        stepped = self.ds.was_step_applied() and math.isfinite(norm)
        return norm, stepped

    @property
    def lr(self) -> float:
        return float(self.ds.get_lr()[0])

    def all_reduce_sum(self, x: Tensor | float) -> Tensor:
        """Sum of ``x`` over ranks, summed in float64 (on the GPU for NCCL, the CPU for gloo)."""
        import torch.distributed as dist

        t = torch.as_tensor(x)
        comm_device = self.module_device() if dist.get_backend() == "nccl" else "cpu"
        out = t.detach().to(comm_device, torch.float64).clone()
        dist.all_reduce(out)
        return out.to(t.device, t.dtype if t.is_floating_point() else torch.float64)

    def all_true(self, flag: bool) -> bool:
        """True only when ``flag`` holds on every rank (ranks must take the same branch)."""
        return bool(self.all_reduce_sum(float(not flag)) == 0)

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def module_device(self) -> torch.device:
        return next(self.module.parameters()).device

    @contextlib.contextmanager
    def rollout_context(self):
        """Full weights on every rank for sampling and evaluation (ZeRO-3); a no-op for ZeRO-2."""
        if self.cfg.zero_stage < 3:
            yield
            return
        from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

        with unwrap_model_for_generation(self.ds):
            yield

    @contextlib.contextmanager
    def gathered_params(self):
        """Every parameter whole on every rank (ZeRO-3), e.g. to export or compare weights."""
        if self.cfg.zero_stage < 3:
            yield
            return
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None):
            yield

    # ---- checkpoints ------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """What goes into ``trainer_state.pt``: the rest lives in DeepSpeed's per-rank files."""
        return {
            "backend": "deepspeed",
            "zero_stage": self.cfg.zero_stage,
            "world_size": self.world_size,
        }

    def restore(self, ckpt_dir: Path, state: dict, policy) -> None:
        """Resume from checkpoint ``ckpt_dir``: after checking that ``state`` (``state_dict``'s)
        comes from the same backend and launch, weights, optimizer and scheduler come from
        ``save_sharded``'s per-rank files (``policy`` holds the partitioned module already).

        DeepSpeed's files are read as tensor data only (:func:`weights_only_torch_load`): a
        foreign or altered file holding other pickled objects raises UnsafeCheckpointError and
        none of it runs."""
        if state.get("backend") != "deepspeed":
            raise ValueError(
                "this checkpoint was written by the torch backend; resume it with "
                "train.backend=torch, or start a DeepSpeed run from its model/ directory "
                "(model.path=<ckpt>/model)"
            )
        if state["world_size"] != self.world_size or state["zero_stage"] != self.cfg.zero_stage:
            raise ValueError(
                f"checkpoint written by {state['world_size']} ranks under ZeRO-{state['zero_stage']}"
                f", resumed with {self.world_size} ranks under ZeRO-{self.cfg.zero_stage}; resume "
                "with the same launch, or start a new run from its consolidated model/ directory"
            )
        with weights_only_torch_load():
            path, _ = self.ds.load_checkpoint(
                str(Path(ckpt_dir) / ZERO_DIR), tag="state",
                load_optimizer_states=True, load_lr_scheduler_states=True,
            )  # fmt: skip
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed state under {Path(ckpt_dir) / ZERO_DIR}")

    def save_sharded(self, ckpt_dir: Path) -> None:
        """Every rank writes its optimizer (and ZeRO-3 parameter) partitions to ``ckpt_dir/zero``."""
        self.ds.save_checkpoint(str(Path(ckpt_dir) / ZERO_DIR), tag="state")

    def export(self, policy, path: Path) -> None:
        """Consolidated HF weights: gather (ZeRO-3) and let rank 0 write ``policy.save(path)``."""
        with self.gathered_params():
            if self.is_main:
                policy.save(path)
        self.barrier()


def policy_module(policy) -> nn.Module:
    """The ``nn.Module`` that holds a policy's weights: ``policy.model`` (VLM) or the policy."""
    module = getattr(policy, "model", policy)
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"{type(policy).__name__} exposes no nn.Module (neither a .model attribute nor a "
            "module itself); the DeepSpeed backend needs one to partition"
        )
    return module


@ENGINES.register("deepspeed")
def deepspeed_engine(policy, cfg: TrainConfig) -> DeepSpeedEngine:
    """``train.backend=deepspeed``: a `DeepSpeedEngine` partitioning the policy's module."""
    return DeepSpeedEngine(policy_module(policy), cfg)
