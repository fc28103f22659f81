# vlserve — the two set-up commands are `make serve` and `make test` (see README.md).
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install test isa faults serve zoo zoo-pretrained zoo-full bench bench-butd gpu results image deploy-test screenshots clean

# torch first (pins read from pyproject.toml), so no dependency pulls another torch build.
# redis-server comes from Debian: the tests start their own on a free loopback port. kubectl too where none is
# installed (Debian's kubernetes-client): the tests render k8s/ with `kubectl kustomize`, which needs no cluster. And
# chromium: the page's tests drive Debian's browser with Playwright (no browser download). And prometheus: a test
# scrapes a served vlserve with it and evaluates the autoscaler's prometheus-adapter rules there. Locust in a virtual
# environment of its own (loadtests/locust-venv.sh): a test runs the load test against a served model.
install:
	command -v redis-server >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server)
	command -v prometheus >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus)
	command -v kubectl >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq kubernetes-client)
	command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium)
	$(PIP) install -q $$($(PYTHON) scripts/pins.py torch torchvision)
	$(PIP) install -q --no-deps $$($(PYTHON) scripts/pins.py --no-deps)
	$(PIP) install -q -e ".[test]"
	PYTHON=$(PYTHON) loadtests/locust-venv.sh >/dev/null

test: install
	$(PYTHON) -m pytest -q

# The batching, parity and export tests under each x86 ISA level this CPU can stand in for (oneDNN and ATen capped
# by ONEDNN_MAX_CPU_ISA / ATEN_CPU_CAPABILITY: AMX, AVX512-BF16, AVX512, AVX2); prints which levels ran. ~2 min a level.
isa: install
	$(PYTHON) scripts/isa_runs.py

# With no VLSERVE_MODEL_DIR / VLSERVE_DETECTOR_DIR the service runs the demo model set, built first if absent.
serve: install
	vlserve serve

zoo: install
	vlserve zoo build --profile demo

zoo-pretrained: install
	vlserve zoo build --profile pretrained

zoo-full: install
	vlserve zoo build --profile full

# The encoder and detector sections of docs/BENCHMARKS.md; every other benchmark's command is in the section it
# writes (docs/BENCHMARKS.md, docs/RELIABILITY.md, docs/RESULTS.md). tests/test_benchmarks_start.py checks they start.
bench: install
	$(PYTHON) benchmarks/encoder.py
	$(PYTHON) benchmarks/detector.py

# On a machine with a CUDA GPU: the tests marked gpu (each skips with its reason where its provider or package is
# missing) and the GPU-against-CPU timings of docs/BENCHMARKS.md. On a lent machine without network: `python
# scripts/gpu_carry.py --reference DIR` here, `bash scripts/gpu_device.sh gpu` and `... cpu` there (the host's AMX
# CPU on 2 pinned cores). docs/EXPORT.md, "Running the GPU checks".
gpu: install
	$(PYTHON) -m pytest -q -ra -m gpu
	$(PYTHON) benchmarks/gpu.py
	@if [ -d "$(BUTD_REFERENCE)" ]; then $(PYTHON) benchmarks/butd.py --device cuda --reference "$(BUTD_REFERENCE)"; \
	else echo "benchmarks/butd.py --device cuda: skipped, BUTD_REFERENCE names no folder (the frcnn-vg reference's lxmert/, never in the repository: docs/BENCHMARKS.md)"; fi

# The real-size bottom-up-attention detector against its reference (REFERENCE: the lxmert/ folder of
# huggingface/transformers-research-projects at the commit scripts/reference_fixtures/frcnn_vg.py names). ~15 min.
bench-butd: install
	$(PYTHON) benchmarks/butd.py --reference "$(REFERENCE)"

# The presets table of docs/RESULTS.md: needs the demo detector (`make zoo`). --force replaces the recorded results
# (benchmarks/results/presets.json and the table), whatever detector and budget they were made with. ~75 min on 2 cores.
results: install
	$(PYTHON) benchmarks/presets.py --finetune-steps 600 --lead-steps 150 --demo-levers --pretrain-steps 300 --grounded-mlm --force

# The service image (vlserve:latest) with no registry needed: the base from Debian (debootstrap) when python:3.11-slim
# is not present, wheels from this machine's pip configuration; PROFILE=demo bakes that model set in. docs/DEPLOYMENT.md
image:
	docker/dockerd-up.sh
	PROFILE=$(PROFILE) docker/build.sh

# The production topology rehearsed with Docker (Redis, two replicas, HAProxy; Redis stopped and a replica SIGTERMed
# under load, then locust): asserts, and records the figures in docs/DEPLOYMENT.md "Rehearsal". About 2 min warm.
deploy-test: install
	PYTHON=$(PYTHON) docker/deploy-test.sh --record

# The page to try it (GET /) in Debian's chromium, one screenshot per task: docs/img/page-*.png (the demo model set).
screenshots: install
	$(PYTHON) scripts/screenshots.py

clean:
	rm -rf build *.egg-info .pytest_cache
