.PHONY: setup test test-fast lint bench generate serve

setup:
	bash scripts/setup.sh

test:
	.venv/bin/python -m pytest -q

test-fast:
	.venv/bin/python -m pytest -q -m "not slow"

lint:
	.venv/bin/ruff check radixserve tests
	.venv/bin/lint-imports
	.venv/bin/python -m mypy

bench:
	.venv/bin/radixserve bench offline --kv-cache-tokens 20000 --json bench_offline.json
	.venv/bin/radixserve bench prefix --kv-cache-tokens 40000 --json bench_prefix.json

generate:
	.venv/bin/radixserve generate "What is the capital of France?"

serve:
	.venv/bin/radixserve serve
