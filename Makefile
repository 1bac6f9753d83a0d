# One command each on a fresh machine: `make demo` runs the default job, `make test` the tests.
# Both run `setup` first (a .venv with this package installed editable, plus dev tools).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PYTEST_ARGS ?=
export MUJOCO_GL ?= egl
export PYOPENGL_PLATFORM ?= egl
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1

.PHONY: setup sysdeps demo test test-all bench lint clean

setup: $(VENV)/.installed

# System libraries for MuJoCo's offscreen EGL rendering (Mesa); installed only when missing.
sysdeps:
	@if ! ldconfig -p | grep -q 'libEGL.so.1' || ! ldconfig -p | grep -q 'libOpenGL.so.0'; then \
		echo "installing EGL/Mesa libraries for offscreen rendering"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			libegl1 libgl1 libopengl0 libegl-mesa0 libgl1-mesa-dri libgbm1 >/dev/null; \
	fi

$(VENV)/.installed: pyproject.toml | sysdeps
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first: deepspeed's build reads the installed torch
	$(BIN)/pip install -q torch==2.14.1 torchvision==0.29.1
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

demo: setup
	$(BIN)/perceptrl demo

# pytest exits 5 when it collects no test; that is not a failure of the suite.
test: setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; rc=0; fi; exit $$rc

test-all: setup
	$(BIN)/python -m pytest -q -m 'not gpu' $(PYTEST_ARGS)

# Long: a few minutes (sim) + 30 min (VLA pixel PPO) + about 30 min (VLM GRPO vs SFT) on 2 cores.
bench: setup
	$(BIN)/python bench/bench_sim.py
	$(BIN)/python bench/bench_vla.py
	$(BIN)/python bench/bench_vlm_grpo.py

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info runs
