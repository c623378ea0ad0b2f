# Trainyard: `make up` runs the local stack and an example job; `make test` runs every test.
# The interpreter .venv is made with: Debian's CPython 3.11 where it is (deploy/lock/debian.txt, group python), else
# python3. Debian builds it with profile-guided and link-time optimization and links it statically; the services
# and agents take about a fifth less CPU on it than on a CPython built without (pyenv's default: a shared library,
# no PGO), as they do in the images (python:3.11-slim, also built so). Looked at as the recipe runs, after
# system-packages.sh installed it.
PYTHON ?= $$(test -x /usr/bin/python3.11 && echo /usr/bin/python3.11 || echo python3)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# What drops a job to its own user in its sandbox where agents are root (agent/isolation/drop.c), built static
# with musl where it is (its start-up costs a tenth of glibc's, which probes the CPU's caches at every exec),
# else with the C compiler and its static C library; setpriv drops where neither is.
DROP   := $(VENV)/bin/trainyard-drop
DROP_CC ?= $(shell command -v musl-gcc 2>/dev/null || echo $(CC))
# Debian's bubblewrap built static with musl and an allocator of its own (deploy/local/build-bwrap.sh): the sandbox
# every job starts in, 0.7 ms of CPU a start less than the system's bwrap, which agents run where this was not built.
BWRAP  := $(VENV)/bin/trainyard-bwrap
# `make up REPLICAS=2`: two processes of each service, one active and one standby.
REPLICAS ?= 1
# `make up OPS=1`: also Prometheus (Debian's package) scraping every process's metrics, on 127.0.0.1:9090.
OPS ?=
# `make up NATS=3`: a cluster of three NATS servers, every stream kept on all three.
NATS ?= 1

# Every Python package, direct and transitive, pinned with its hashes: deploy/lock/dev.txt here and in CI,
# deploy/lock/runtime.txt (its subset for the services, agents and CLI) in the images. `make lock` changes them.
LOCK   := deploy/lock/dev.txt
PIP    := $(PY) -m pip --disable-pip-version-check
COMPILE = $(VENV)/bin/pip-compile --quiet --generate-hashes --allow-unsafe --strip-extras --all-build-deps \
          --no-emit-index-url --no-emit-find-links --no-emit-trusted-host $(if $(UPGRADE),--upgrade,)

.PHONY: install lock up demo down status test test-hosts lint schemas clean

install: $(STAMP) $(DROP) $(BWRAP)

## The Debian packages of deploy/lock/debian.txt, then .venv built anew from the lock: exactly its packages, at
## its versions and hashes (pip refuses anything else), and the project itself, editable, without dependencies.
$(STAMP): $(LOCK) deploy/lock/debian.txt deploy/local/system-packages.sh
	bash deploy/local/system-packages.sh
	$(PYTHON) -m venv --clear $(VENV)
	$(PIP) install -q --require-hashes -r $(LOCK)
	$(PIP) install -q --no-deps --no-build-isolation -e .
	$(PY) deploy/lock/verify.py
	touch $(STAMP)

$(DROP): agent/isolation/drop.c $(STAMP)
	@$(DROP_CC) -O2 -static -Wall -Wextra -Werror -o $@ $< \
	  || echo "$@ not built (a C compiler and a static C library are needed): jobs drop to their user with setpriv"

$(BWRAP): deploy/local/build-bwrap.sh deploy/local/bwrap-arena.c $(STAMP)
	@bash deploy/local/build-bwrap.sh $@ \
	  || echo "$@ not built (see above): agents start jobs' sandboxes with the system's bwrap"

## Compile deploy/lock/ from pyproject.toml: pins that still fit are kept (`make lock UPGRADE=1` moves every
## package to its newest release); then .venv is rebuilt from it. Run `make test` before committing the change.
## PyTorch's CPU build (torch==2.13.0+cpu) is found in pip's find-links of this kind of machine.
lock:
	test -x $(VENV)/bin/pip-compile || $(MAKE) install
	$(COMPILE) -o deploy/lock/runtime.txt pyproject.toml
	$(COMPILE) --extra dev --extra jobs -c deploy/lock/runtime.txt -o $(LOCK) pyproject.toml
	$(MAKE) install

## Start NATS, PostgreSQL, and a supervisor that runs (and restarts) the four services and two node agents;
## then run the example job. `make status` lists every process, `make down` stops them all.
up: install
	$(PY) -m devstack up --replicas $(REPLICAS) --nats $(NATS) $(if $(OPS),--ops,)
	$(PY) -m client.demo

demo: install
	$(PY) -m client.demo

down:
	$(PY) -m devstack down

status:
	$(PY) -m devstack status

## Every test: unit, integration (real NATS and PostgreSQL) and end to end (the whole stack), on a worker process
## per core (pytest-xdist; `make test WORKERS=0` runs them in this one). Each worker starts NATS and PostgreSQL of
## its own, and every test has its own database, streams and stack; idle workers take tests from busy ones.
## Tests empty the streams of the NATS server they use: one given by NATS_URL is used by a single worker.
WORKERS ?= $(if $(NATS_URL),0,auto)
test: install
	$(PY) -m pytest -n $(WORKERS) --dist worksteal

## The end-to-end tests on separate hosts: every node agent in a network namespace of its own (root, iproute2).
test-hosts: install
	$(PY) -m pytest tests/e2e/test_hosts.py -v

lint: install
	$(PY) deploy/lock/verify.py
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy .
	$(VENV)/bin/lint-imports
	$(PY) deploy/k8s/validate.py

## Regenerate what is made from the contracts: docs/schemas/, docs/cli.md's table of operations, and the NATS
## permissions of every role in deploy/ (nats-server.conf, the Helm values). Tests fail while any is stale.
schemas: install
	$(PY) -m libs.contracts.schema_export docs/schemas
	$(PY) -m libs.contracts.operations.catalogue docs/cli.md
	$(PY) -m libs.natsroles > deploy/nats/nats-server.conf
	$(PY) deploy/k8s/validate.py --write-nats-merge

clean:
	rm -rf $(VENV) .trainyard .pytest_cache .mypy_cache .ruff_cache
