#!/usr/bin/env bash
# Issue 15 goal 6 on a machine with CUDA, in one call: the determinism tests (merged = trial-based,
# a branch from a shared prefix = an independent run, a checkpoint snapshot = its save, spawned and
# forked workers give the same results: the fork server must not initialise CUDA), then
# benchmarks/merge_savings.py and benchmarks/worker_overhead.py on cuda. Runs go to $WORK (default
# /tmp/cuda-check); the logs and the two benchmarks' JSON files (5 files) are copied to $OUT (default
# runs/cuda-check). Where the project's dependencies are missing (the lent device
# machine has torch but not pydantic, orjson, rocksdict, ...), wheels in .whl/ are installed into
# /tmp/site first, and a `stagetree` console script is written next to the interpreter. To fetch
# them here for a Python 3.12 device (pin each to the version `.venv/bin/pip list` shows):
#   .venv/bin/python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl \
#       pydantic pydantic_core annotated-types typing-inspection typing_extensions orjson rocksdict \
#       opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions importlib_metadata
set -u
OUT=${OUT:-runs/cuda-check}
WORK=${WORK:-/tmp/cuda-check}
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
PY=$(python3 -c 'import sys; print(sys.executable)')
if [ ! -x "$(dirname "$PY")/stagetree" ]; then  # guarded: worker processes are spawned, re-importing __main__
    printf '#!%s\nimport sys\nfrom stagetree.cli import console_main\nif __name__ == "__main__":\n    sys.exit(console_main())\n' \
        "$PY" >"$(dirname "$PY")/stagetree" && chmod +x "$(dirname "$PY")/stagetree"
fi
nvidia-smi -L
python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))' || exit 1
rc=0
echo "== determinism tests on cuda ($SECONDS s)"
timeout 270 python3 -m pytest -q -p no:cacheprovider -o addopts= -rs tests/test_training_session.py \
    tests/test_worker_pipe.py tests/test_e2e.py::test_merged_and_trial_based_runs_give_identical_metrics \
    tests/test_e2e.py::test_spawned_and_forked_workers_give_identical_results 2>&1 | tee "$OUT/pytest.log" | tail -8
[ "${PIPESTATUS[0]}" = 0 ] || rc=1
echo "== merge_savings on cuda (examples/digits.py, 2 workers on one GPU) ($SECONDS s)"
timeout 150 python3 benchmarks/merge_savings.py --workers 2 --out "$WORK/ms" >"$OUT/merge_savings.log" 2>&1 || rc=1
tail -45 "$OUT/merge_savings.log"
cp "$WORK/ms/merge_savings.json" "$OUT/" 2>/dev/null
echo "== worker_overhead on cuda:0 ($SECONDS s)"
timeout 120 python3 benchmarks/worker_overhead.py --device cuda:0 --stages 300 --out "$WORK/wo" >"$OUT/worker_overhead.log" 2>&1 \
    || rc=1
tail -20 "$OUT/worker_overhead.log"
cp "$WORK/wo/worker_overhead.json" "$OUT/" 2>/dev/null
echo "== done ($SECONDS s)"
exit $rc
