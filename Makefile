# raypd: two commands do everything (see README).
#   make run   - set up, then serve SmolLM2 with two role-flexible engines (one core each) on 127.0.0.1:8000
#   make test  - set up, then run the whole test suite
#   make bench - set up (+ the benchmark's extra), then benchmarks/pd_vs_vllm.py (~50 min;
#                BENCH_ARGS=--quick for a short run; on a shared box prefix with a lock,
#                e.g. BENCH_LOCK="flock /work/ray.lock")
.PHONY: setup run test unit bench bench-setup clean

setup:
	bash scripts/setup.sh

run: setup
	.venv/bin/raypd up --config configs/local.yaml

test: setup
	bash scripts/test.sh

unit: setup
	.venv/bin/python -m pytest tests/unit -q

# The `bench` extra of pyproject.toml, without dependencies (vLLM's pin stays as it is).
bench-setup: setup
	.venv/bin/python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['bench']))" \
		| xargs .venv/bin/python -m pip install -q --no-deps

bench: bench-setup
	$(BENCH_LOCK) env PYTHONPATH=$(CURDIR) .venv/bin/python benchmarks/pd_vs_vllm.py $(BENCH_ARGS)

clean:
	rm -rf .venv .raypd-setup-stamp
