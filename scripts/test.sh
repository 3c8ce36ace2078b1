#!/usr/bin/env bash
# The test suite as CI runs it (after `bash scripts/setup.sh test`): the import-layer contracts, then the tests in
# two passes. Extra arguments go to both pytest passes (e.g. -x, -k pattern).
#   1. every test not marked `alone`, two test files at a time (pytest-xdist; a file's tests stay in one process,
#      so its module fixtures are built once). The unit and integration tests spend about a third of their time
#      waiting on Ray, subprocesses and sockets; two at a time keep a 2-core machine busy.
#   2. the `alone` tests one at a time: every end-to-end and GPU test (each run fills the cores by itself, and some
#      check state that is the whole machine's: shared-memory blocks, multiprocessing folders, forkservers) and the
#      few others marked so (tests/conftest.py).
# Both passes run even when the first fails; the exit status is non-zero if either did.
set -uo pipefail
cd "$(dirname "$0")/.."
.venv/bin/lint-imports || exit 1
status=0
.venv/bin/python -m pytest -n 2 --dist loadfile -m "not alone" "$@" || status=1
.venv/bin/python -m pytest -m alone "$@" || status=1
exit $status
