#!/usr/bin/env bash
# The test suite as CI runs it (after `bash scripts/setup.sh test`): the import-layer contracts, then the tests in
# two passes. Extra arguments go to both pytest passes (e.g. -x, -k pattern).
#   1. every test not marked `alone`, two test files at a time (pytest-xdist; a file's tests stay in one process,
#      so its module fixtures are built once). The unit and integration tests spend about a third of their time
#      waiting on Ray, subprocesses and sockets; two at a time keep a 2-core machine busy.
#   2. the `alone` tests one at a time: every end-to-end and GPU test (each run fills the cores by itself, and some
#      check state that is the whole machine's: shared-memory blocks, multiprocessing folders, forkservers) and the
#      few others marked so (tests/conftest.py).
# Both passes run even when the first fails; the exit status is non-zero if either did. A pass that selects no
# test (a path or -k that picks only one kind) counts as passed, unless neither pass selects any (pytest's 5).
set -uo pipefail
cd "$(dirname "$0")/.."
.venv/bin/lint-imports || exit 1
.venv/bin/python -m pytest -n 2 --dist loadfile -m "not alone" "$@"
side_by_side=$?
.venv/bin/python -m pytest -m alone "$@"
alone=$?
if [ $side_by_side -eq 5 ] && [ $alone -eq 5 ]; then exit 5; fi
for status in $side_by_side $alone; do
  if [ $status -ne 0 ] && [ $status -ne 5 ]; then exit 1; fi
done
exit 0
