#!/usr/bin/env bash
# The GPU smoke suite (tests/gpu, docs/benchmarks.md#gpu-smoke-suite) on a bare GPU machine, in minutes.
#   bash scripts/gpu_smoke.sh [-- PYTEST_ARGS]               # with network: installs what is missing, runs the suite
#   bash scripts/gpu_smoke.sh --wheels DIR [-- PYTEST_ARGS]  # offline: installs every wheel in DIR (fetched before)
#   bash scripts/gpu_smoke.sh --fetch DIR [PYTHON_VERSION]    # on a machine with network: fetch those wheels (3.12)
#   bash scripts/gpu_smoke.sh [--wheels DIR] --pipeline [-- PYTEST_ARGS]
#       only the pipeline on one GPU: the tiny disaggregated pipeline and the hybrid placement with their two
#       placement GPUs on the one device (weights over CUDA IPC), then benchmarks/pipeline_vs_collocated.py on the
#       machine's cores with its GPU hidden; about 5 minutes after the install, within a lent machine's 15
# It never installs torch or its dependencies: the machine's CUDA build is used. Packages go, without their
# dependencies, into a folder ($RLINF_PIPE_GPU_SITE, default /tmp/rlinf-pipe-gpu-site) put in front on PYTHONPATH,
# so it works whether the machine's python is a system one or a virtual environment of its own (a venv made over
# a venv would not see the outer one's torch). Tests that need Ray or sglang skip where they are missing;
# `pip install -e '.[sglang]'` first to run the SGLang ones. RLINF_PIPE_GPU_DRY_RUN=1 runs the suite's logic on CPU.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
# import name = requirement; installed with --no-deps, so each one's own needs are listed too. Assumed present, as in
# CUDA torch images: torch, transformers (with tokenizers, safetensors, huggingface_hub), numpy, packaging, PyYAML,
# protobuf, requests, click, filelock, msgpack, sympy, attrs (checked below: a clear error where one is missing).
ASSUMED=(torch transformers tokenizers safetensors numpy yaml google.protobuf requests click filelock msgpack sympy attr)
NEEDED=(
    "pytest=pytest>=8.2" "pluggy=pluggy>=1.5" "iniconfig=iniconfig"
    "msgspec=msgspec>=0.19" "omegaconf=omegaconf>=2.3" "megatron.core=megatron-core>=0.16.1,<0.17" "zmq=pyzmq>=26"
    "math_verify=math-verify>=0.8" "latex2sympy2_extended=latex2sympy2_extended>=1.0"
    "antlr4=antlr4-python3-runtime==4.13.2" "tensorboardX=tensorboardX>=2.6" "pytest_asyncio=pytest-asyncio>=0.24"
    "pytest_timeout=pytest-timeout>=2.3" "ray=ray>=2.50" "jsonschema=jsonschema" "referencing=referencing"
    "rpds=rpds-py" "jsonschema_specifications=jsonschema-specifications"
)
requirements() { for entry in "${NEEDED[@]}"; do echo "${entry#*=}"; done; }

if [ "${1:-}" = "--fetch" ]; then
    dir="${2:?usage: --fetch DIR [PYTHON_VERSION]}"; version="${3:-3.12}"
    mapfile -t wanted < <(requirements)
    "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
        -d "$dir" "${wanted[@]}"
    # Ray's wheel (~80 MB) without what the suite never loads (Java jars, RLlib, Data, Serve, Train, Tune, the
    # dashboard's web UI): about half the size, for machines reached through a size-limited copy.
    "$PYTHON" - "$dir" <<'PY'
import csv, io, pathlib, sys, zipfile

DROP = ("ray/jars/", "ray/rllib/", "ray/data/", "ray/serve/", "ray/train/", "ray/tune/", "ray/llm/",
        "ray/dashboard/client/build/")
for wheel in pathlib.Path(sys.argv[1]).glob("ray-*.whl"):
    slim = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
        kept = [i for i in src.infolist() if not i.filename.startswith(DROP)]
        names = {i.filename for i in kept}
        for info in kept:
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):  # list only what is left
                rows = [r for r in csv.reader(io.StringIO(data.decode())) if r and r[0] in names]
                out = io.StringIO()
                csv.writer(out, lineterminator="\n").writerows(rows)
                data = out.getvalue().encode()
            dst.writestr(info, data)
    before = wheel.stat().st_size
    slim.replace(wheel)
    print(f"{wheel.name}: {before / 2**20:.0f} MiB -> {wheel.stat().st_size / 2**20:.0f} MiB")
PY
    echo "wheels for Python $version in $dir: copy them with the tree, then: bash scripts/gpu_smoke.sh --wheels $dir"
    exit 0
fi
wheels=""
selection=(tests/gpu)
while [ $# -gt 0 ]; do
    case "$1" in
        --wheels) wheels="${2:?usage: --wheels DIR}"; shift 2 ;;
        --pipeline) selection=(tests/gpu/test_pipeline_one_gpu.py tests/gpu/test_pipeline_benchmark_gpu.py); shift ;;
        --) shift; break ;;
        *) break ;;
    esac
done
if [ -n "$wheels" ] && ! compgen -G "$wheels/*.whl" >/dev/null; then
    echo "error: no wheels in $wheels (see --fetch)" >&2; exit 1
fi

site="${RLINF_PIPE_GPU_SITE:-/tmp/rlinf-pipe-gpu-site}"
export PYTHONPATH="$site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$site/bin:$PATH"  # Ray's `ray` and its servers' entry points
install=(-m pip install --quiet --no-deps --no-compile --no-cache-dir --upgrade --target "$site")
# The import names among "$@" that $PYTHON cannot import, one a line: one process tries them all (a process each
# took half a minute, torch imported again in most); a name it did not get to (a crash) counts as missing.
unimportable() {
    local imported
    imported="$("$PYTHON" - "$@" <<'PY' 2>/dev/null | sed -n 's/^imported: //p'
import importlib
import sys

for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception:
        continue
    print(f"imported: {name}", flush=True)
PY
)" || true
    local name
    for name in "$@"; do
        grep -qxF "$name" <<<"$imported" || echo "$name"
    done
}
declare -A wanted_by_name=()  # (without --wheels: what to install; with them, everything in them is installed)
if [ -z "$wheels" ]; then
    for entry in "${NEEDED[@]}"; do wanted_by_name["${entry%%=*}"]="${entry#*=}"; done
fi
absent=() missing=()
while read -r name; do  # (one check of both lists: each process pays for torch's import)
    if [ -n "${wanted_by_name[$name]:-}" ]; then missing+=("${wanted_by_name[$name]}"); else absent+=("$name"); fi
done < <(unimportable "${ASSUMED[@]}" ${wanted_by_name[@]+"${!wanted_by_name[@]}"})
if [ ${#absent[@]} -gt 0 ]; then
    echo "error: $PYTHON cannot import ${absent[*]}, which the suite expects with the machine's torch; install" \
         "them (pip install torch transformers pyyaml protobuf requests click filelock msgpack sympy attrs)" >&2
    exit 1
fi
if [ -n "$wheels" ]; then
    "$PYTHON" "${install[@]}" --no-index "$wheels"/*.whl
else
    if [ ${#missing[@]} -gt 0 ]; then
        echo "installing into $site: ${missing[*]}"
        "$PYTHON" "${install[@]}" "${missing[@]}"
    fi
fi

if [ -z "${RLINF_PIPE_GPU_DRY_RUN:-}" ]; then
    "$PYTHON" - <<'PY'
import sys

import torch

if not torch.cuda.is_available():
    sys.exit("error: torch sees no CUDA GPU here (torch " + torch.__version__ + "); the GPU suite needs one")
names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {len(names)} GPU(s): {', '.join(names)}")
PY
fi
cd "$ROOT"
exec "$PYTHON" -m pytest "${selection[@]}" -m gpu -v -rs -s -p no:cacheprovider --timeout 900 "$@"
