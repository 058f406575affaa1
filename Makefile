# raypd: two commands do everything (see README).
#   make run   - set up, then serve SmolLM2 with one prefill + one decode engine on 127.0.0.1:8000
#   make test  - set up, then run the whole test suite
.PHONY: setup run test unit bench clean

setup:
	bash scripts/setup.sh

run: setup
	.venv/bin/raypd up --config configs/local.yaml

test: setup
	bash scripts/test.sh

unit: setup
	.venv/bin/python -m pytest tests/unit -q

clean:
	rm -rf .venv .raypd-setup-stamp
