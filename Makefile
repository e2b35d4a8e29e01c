# Two commands: `make run` and `make test`. Each builds .venv from scratch when needed. `make test-real` (not part of
# `make test`): a real llama.cpp llama-server, built once from the pinned llama-cpp-python sdist and cached, behind sluice.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
STUBS  := sluice/admin/v1/admin_pb2.py sluice/admin/v1/admin_pb2_grpc.py

.PHONY: run test test-real install stubs bench clean prometheus

run: install
	$(VENV)/bin/sluice up

# mypy --strict over controlplane/, sluice/, enginesim/, ratelimit/, bench/, rig/ and tests/ first (settings: pyproject's
# [tool.mypy]; its cache in .mypy_cache makes a rerun take seconds), then every test.
test: install prometheus
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -p no:cacheprovider

# Builds llama-server first unless ${XDG_CACHE_HOME:-~/.cache}/sluice/llama.cpp/<version>/ holds it (about 15 minutes on 2
# cores, at nice 19; the time is printed), then runs tests/real through sluice and Envoy (under a minute).
test-real: install
	$(PY) -m rig.llama build
	$(PY) -m pytest -q -p no:cacheprovider tests/real

install: $(STAMP) $(STUBS)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,bench]'
	touch $(STAMP)

# This project's own gRPC stubs are generated, never edited by hand.
$(STUBS): proto/sluice/admin/v1/admin.proto $(STAMP)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --grpc_python_out=. --pyi_out=. proto/sluice/admin/v1/admin.proto

stubs: $(STUBS)

# Debian's prometheus + promtool for tests/e2e/test_prometheus.py (installed when missing; quiet; starts no service).
prometheus:
	@sh deploy/tools/ensure-prometheus.sh

# Every benchmark, one after another, each printing its figures and writing bench/results/<scenario>.md (several hours:
# steady and prefix run every arm at every load level; each report records its own run time). A bench whose target is
# missed exits non-zero: the rest still run, and the missed ones are listed at the end (and make fails).
BENCHES := observe overhead t10 steady cag4 fleet chaos replicas ratelimit prefix scale estimates fairness lora shapes
bench: install
	@missed=""; for b in $(BENCHES); do $(VENV)/bin/sluice bench $$b || missed="$$missed $$b"; done; \
	if [ -n "$$missed" ]; then echo "bench: targets missed or failed in:$$missed"; exit 1; fi

clean:
	rm -rf $(VENV) $(STUBS) sluice/admin/v1/admin_pb2.pyi
