#!/usr/bin/env bash
# Run all tests: sets up .venv if needed (scripts/setup.sh --no-run), builds the C++ unit
# tests, then pytest (which builds the fixture models it needs into tests/fixtures/models).
#   bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --no-run
exec .venv/bin/python -m pytest "$@"
