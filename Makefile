# The two commands of the README, each setting up its own virtual environment first.
#   make demo   run the whole job on embedded defaults
#   make test   run the test suite against the installed package
#   make gpu-check   every GPU path on a machine with one CUDA GPU (docs/benchmarks.md)
#   make gpu-learn   the first learning curve on real review text, on one GPU (docs/benchmarks.md)

VENV ?= .venv
PYTHON ?= python3
# Each command installs what it runs: the demo the runtime only; the tests the dev, Dask and team extras
# on top (about 40 s more that a newcomer's first command does not wait for).
RUNTIME := $(VENV)/.installed-runtime
EXTRAS := $(VENV)/.installed-extras
# The CPU build of PyTorch: never let pip resolve the CUDA one (several GB).
TORCH := torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# pytest-xdist workers for make test, each taking whole test files (their module fixtures stay one).
# Three on two cores: with two the suite left the cores about 10% idle (servers, sleeps, subprocess
# waits) and ended on one long file; three took the same suite from 13:06 to 11:16 (warm venvs, quiet).
# --no-loadscope-reorder: the workers take the costliest files first (tests/schedule.py), not xdist's
# order (the files with the most tests first), which left the few long files to the end. Four
# workers took longer than three (12:06 against 10:28): on two cores they slowed each other more.
TEST_WORKERS ?= 3

.PHONY: demo test test-long gpu-check gpu-learn gpu-data lint clean

# uv resolves and installs the packages beside torch several times faster than pip (the newcomer's first
# command waits on it); torch itself and uv come through pip, whose index settings find the CPU build.
# pip stays the fallback where uv cannot reach an index that pip can. uv writes no bytecode unless asked
# (pip does): where PYTHONDONTWRITEBYTECODE is set, as on these machines, every process then compiled
# MLflow, Prefect and scikit-learn from source again: importing them with torch and pyarrow took 13.3 s
# instead of 5.8 s in every CLI, rank and worker (compiling them once at install: about 50 s).
UV := uv==0.13.9
FAST_INSTALL = $(VENV)/bin/uv pip install -q --compile-bytecode --python $(VENV)/bin/python \
	$(if $(PIP_FIND_LINKS),--find-links $(PIP_FIND_LINKS)) -c constraints.txt

$(RUNTIME): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q "$(TORCH)" "$(UV)" 2>/dev/null \
		|| $(VENV)/bin/pip install -q "$(TORCH)" "$(UV)" --extra-index-url $(TORCH_INDEX)
	$(FAST_INSTALL) . || $(VENV)/bin/pip install -q -c constraints.txt .
	touch $(RUNTIME)

$(EXTRAS): $(RUNTIME)
	$(FAST_INSTALL) ".[dev,dask,team]" || $(VENV)/bin/pip install -q -c constraints.txt ".[dev,dask,team]"
	touch $(EXTRAS)

demo: $(RUNTIME)
	rm -rf build
	$(VENV)/bin/pip install -q --no-deps --force-reinstall . >/dev/null
	$(VENV)/bin/mlstm-sentiment demo

test: $(EXTRAS)
	rm -rf build
	$(VENV)/bin/pip install -q --no-deps --force-reinstall . >/dev/null
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	@# mypy (about 60 s on one core from a cold cache) runs beside pytest, niced: the suite leaves the cores
	@# about 13% idle (servers starting, subprocess waits), and mypy fits there instead of taking CPU from
	@# the tests. Either failing fails the target.
	nice -n 15 $(VENV)/bin/mypy > $(VENV)/mypy.log 2>&1 & types=$$!; \
	$(VENV)/bin/pytest -m "not long" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=40; tests=$$?; \
	wait $$types; typed=$$?; echo "mypy:"; cat $(VENV)/mypy.log; \
	[ $$tests = 0 ] && [ $$typed = 0 ]

# The end-to-end runs that take a minute or more each (the demo, the pipeline, a champion's transfer, the
# outage, deployments on workers; tests/README.md lists them): about 30 minutes on two cores, so CI's test
# command leaves them out.
test-long: $(EXTRAS)
	rm -rf build
	$(VENV)/bin/pip install -q --no-deps --force-reinstall . >/dev/null
	$(VENV)/bin/pytest -m long

# Every GPU path in at most 7 minutes (the parts' limits span 6.5), one table last (benchmarks/gpu_check.py). It runs with that
# machine's Python and CUDA build of torch from the working tree, not this venv's CPU build, so it
# needs no install beyond the wheels tasks.pretrain.train imports; without a GPU it says so and fails.
gpu-check:
	PYTHONPATH=.$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

# paper_4096 trained in bf16 on real review text for at most 5 minutes, with validation bits per byte
# and the L1 probe on SST and IMDB along the way (benchmarks/gpu_learn.py). Its data is the bundle
# `make gpu-data` packs here from the shared data into .gpu-data/ (ignored; under 48 MiB, carried to a
# lent GPU machine with carry [".gpu-data"]). Needs torch, numpy, numba and scipy; no pydantic.
gpu-learn:
	PYTHONPATH=.$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) benchmarks/gpu_learn.py --record $(GPU_LEARN_ARGS)

gpu-data:
	PYTHONPATH=.$${PYTHONPATH:+:$$PYTHONPATH} $(VENV)/bin/python benchmarks/pack_gpu_data.py

clean:
	rm -rf $(VENV) build *.egg-info .mlstm-sentiment
