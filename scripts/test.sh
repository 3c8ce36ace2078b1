#!/usr/bin/env bash
# The test suite as CI runs it (after `bash scripts/setup.sh test` and `bash scripts/setup.sh pins`): the
# import-layer contracts and the type check (mypy over runtime/, runner/ and workers/: the driver's calls to the
# worker groups are typed, pyproject.toml's [tool.mypy]), then the tests in two passes, then the pins pass. Extra
# arguments go to the first two pytest passes (e.g. -x, -k pattern).
#   1. every test not marked `alone`, two test files at a time (pytest-xdist; a file's tests stay in one process,
#      so its module fixtures are built once). The unit and integration tests spend about a third of their time
#      waiting on Ray, subprocesses and sockets; two at a time keep a 2-core machine busy.
#   2. the `alone` tests one at a time: every end-to-end and GPU test (each run fills the cores by itself, and some
#      check state that is the whole machine's: shared-memory blocks, multiprocessing folders, forkservers) and the
#      few others marked so (tests/conftest.py).
#   3. the pins pass, where .venv-pins exists and no argument was given (or alone, with `--pins [ARGS]`): the
#      model, tokenizer, conversion and rollout tests (PINS_TESTS) again in .venv-pins, with the transformers /
#      tokenizers / huggingface_hub versions sglang's extra resolves to on a GPU node (constraints-sglang.txt),
#      and tests/pins: whether the extra still resolves to them (pip's dry run against the registry).
# RLINF_PIPE_SKIP_STATIC_CHECKS=1 leaves out lint-imports and mypy (the script's own tests, which check how its
# passes select and fail, set it: the checks are the same at every call and cost a minute of CPU each time).
# Every pass runs even when an earlier one fails; the exit status is non-zero if any did. A pass that selects no
# test (a path or -k that picks only one kind) counts as passed, unless no pass selects any (pytest's 5).
set -uo pipefail
cd "$(dirname "$0")/.."
PINS_TESTS=(tests/pins tests/unit/test_tiny_model.py tests/unit/test_hf_config.py tests/unit/test_data_templates.py
            tests/unit/test_convert.py tests/unit/test_model_fit.py tests/unit/test_rollout_engine.py
            tests/unit/test_sglang_engine.py)
statuses=()
if [ "${1:-}" = "--pins" ]; then
  shift
  if [ ! -x .venv-pins/bin/python ]; then
    echo "error: no .venv-pins here; make it with: bash scripts/setup.sh pins" >&2
    exit 1
  fi
  pins_pass=1
else
  if [ "${RLINF_PIPE_SKIP_STATIC_CHECKS:-}" != 1 ]; then
    .venv/bin/lint-imports || exit 1
    .venv/bin/mypy || exit 1
  fi
  .venv/bin/python -m pytest -n 2 --dist loadfile -m "not alone" "$@"
  statuses+=($?)
  .venv/bin/python -m pytest -m alone "$@"
  statuses+=($?)
  pins_pass=""
  if [ $# -eq 0 ] && [ -x .venv-pins/bin/python ]; then pins_pass=1; fi
fi
if [ -n "$pins_pass" ]; then
  RLINF_PIPE_PINS_PASS=1 .venv-pins/bin/python -m pytest -n 2 --dist loadfile "${PINS_TESTS[@]}" "$@"
  statuses+=($?)
fi
failed=0 selected=0
for status in "${statuses[@]}"; do
  if [ "$status" -ne 5 ]; then selected=1; fi
  if [ "$status" -ne 0 ] && [ "$status" -ne 5 ]; then failed=1; fi
done
if [ $failed -eq 1 ]; then exit 1; fi
if [ $selected -eq 0 ]; then exit 5; fi
exit 0
