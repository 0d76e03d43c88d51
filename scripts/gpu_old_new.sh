#!/usr/bin/env bash
# An old commit beside this tree on one device machine (a refactor's "behaviour unchanged" check).
# The old tree is unpacked in .old (git-ignored; carry it): git archive OLD | tar -x -C .old
#   bash scripts/gpu_old_new.sh tests [PYTEST ARGS]   # this tree's tests on the GPU
#   bash scripts/gpu_old_new.sh kernels               # bench.kernels, old then new
#   bash scripts/gpu_old_new.sh serve CONFIG...       # the serving ladder (gpu_serve_check.sh), old then new
#                                                     # (TREES="new old": the other order)
# Results under $OUT (kernels_old.json, kernels_new.json, serve_old/, serve_new/); PACK=name.tgz packs them.
set -uo pipefail
mode=$1; shift
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1 && ! python3 -c "import fastapi, uvicorn" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 SPARSESERVE_DATA_DIR=${SPARSESERVE_DATA_DIR:-$PWD/.data}
rc=0
case $mode in
  tests)
    PYTHONPATH=$PWD:$PYTHONPATH python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee "$OUT/tests.log" | tail -40
    rc=${PIPESTATUS[0]} ;;
  kernels)
    for tree in old new; do
      dir=$PWD; [ $tree = old ] && dir=$PWD/.old
      (cd "$dir" && PYTHONPATH=$dir:$PYTHONPATH python3 -m sparseserve.bench.kernels --json "$OUT/kernels_$tree.json") \
        2>&1 | tail -20 || rc=1
    done ;;
  serve)
    for tree in ${TREES:-old new}; do
      server=""; [ $tree = old ] && server=$PWD/.old
      OUT=$OUT/serve_$tree SERVER_TREE=$server LOGS=/tmp/serve_logs_$tree bash scripts/gpu_serve_check.sh "$@" || rc=1
    done ;;
  *) echo "unknown mode $mode (tests, kernels, serve)"; exit 2 ;;
esac
if [ -n "${PACK:-}" ]; then
  (cd "$OUT" && tar czf "/tmp/$PACK" --exclude "$PACK" . && find . -mindepth 1 -delete && mv "/tmp/$PACK" .)
fi
exit $rc
