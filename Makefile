.PHONY: setup test lint bench generate

setup:
	bash scripts/setup.sh

test:
	.venv/bin/python -m pytest -q

lint:
	.venv/bin/ruff check radixserve tests
	.venv/bin/lint-imports

bench:
	.venv/bin/radixserve bench offline --json bench_offline.json

generate:
	.venv/bin/radixserve generate "What is the capital of France?"
