# Trainyard: `make up` runs the local stack and an example job; `make test` runs every test.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
# `make up REPLICAS=2`: two processes of each service, one active and one standby.
REPLICAS ?= 1
# `make up OPS=1`: also Prometheus (Debian's package) scraping every process's metrics, on 127.0.0.1:9090.
OPS ?=
# `make up NATS=3`: a cluster of three NATS servers, every stream kept on all three.
NATS ?= 1

.PHONY: install up demo down status test test-hosts lint schemas clean

install: $(STAMP)

$(STAMP): pyproject.toml deploy/local/system-packages.sh
	bash deploy/local/system-packages.sh
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0 numpy
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

## Start NATS, PostgreSQL, and a supervisor that runs (and restarts) the four services and two node agents;
## then run the example job. `make status` lists every process, `make down` stops them all.
up: install
	$(PY) -m libs.devstack up --replicas $(REPLICAS) --nats $(NATS) $(if $(OPS),--ops,)
	$(PY) -m client.demo

demo: install
	$(PY) -m client.demo

down:
	$(PY) -m libs.devstack down

status:
	$(PY) -m libs.devstack status

## Every test: unit, integration (real NATS and PostgreSQL) and end to end (the whole stack).
test: install
	$(PY) -m pytest

## The end-to-end tests on separate hosts: every node agent in a network namespace of its own (root, iproute2).
test-hosts: install
	$(PY) -m pytest tests/e2e/test_hosts.py -v

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy .
	$(VENV)/bin/lint-imports
	$(PY) deploy/k8s/validate.py

## Regenerate docs/schemas/ from the contracts.
schemas: install
	$(PY) -m libs.contracts.schema_export docs/schemas

clean:
	rm -rf $(VENV) .trainyard .pytest_cache .mypy_cache .ruff_cache
