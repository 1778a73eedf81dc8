#!/usr/bin/env bash
# The multi-worker scaling curve on a lent many-core machine, in one call (issue 27).
#
# Before: TensorFlow goes over in five calls (../shared/tools/device-tf.sh packs it into
# .devtf1..5; each of the first four calls copies its part: mkdir -p /tmp/w && cp .devtfK/part.0*
# /tmp/w/). This is the fifth call, carrying .devtf5:
#
#   bash scripts/device_scaling.sh [BUDGET_SECONDS] [WORKERS] [ROUNDS] [VARIANTS] [IDLE_MS]
#
# e.g. `bash scripts/device_scaling.sh 590 1,8,16 1 tfdist,stock,control,control_idle 70` (the
# defaults). It unpacks and installs TensorFlow (about 10 s), records the machine, then runs
# `experiments.bench_multiworker --scaling_only --models=conv --input=per_worker
# --variants=VARIANTS --control_idle_ms=IDLE_MS` until BUDGET_SECONDS minus a margin, writing
# $OUT/scaling.json after every configuration (a run cut short keeps what it measured) and
# $OUT/scaling.log, with every variant's CPU per step by thread. A conv configuration takes
# about 36 s on 16 Xeon vCPUs (16 workers about 70 s): the defaults are 10 configurations,
# about 7 min; the whole curve 1,2,4,8,16 with tfdist,stock,control is 14, about 8 min.
# control_idle asks whether idling (as a linked worker waits for its peers) makes the next
# step's compute dearer on that machine (docs/performance.md, the second 16-core lease).
# Delete .devtf1..5 afterwards: large ignored files in the checkout slow the launcher's tests.
set -u
t0=$(date +%s)
budget=${1:-590}
workers=${2:-1,8,16}
rounds=${3:-1}
variants=${4:-tfdist,stock,control,control_idle}
idle_ms=${5:-70}
out=${OUT:-/tmp/device_scaling}
mkdir -p "$out"
left() { echo $((budget - ($(date +%s) - t0))); }

if ! python3 -c 'import tensorflow' 2>/dev/null; then
  mkdir -p /tmp/w && cp .devtf5/part.04 /tmp/w/ \
    && (cd /tmp/w && cat part.0* | tar x) \
    && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
      /tmp/w/whl/*.whl \
    || { echo "device_scaling: TensorFlow could not be installed from /tmp/w (are part.00-part.04" \
              "there? see ../shared/tools/device-tf.sh)" >&2; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONPATH=${PYTHONPATH:-$PWD} TF_CPP_MIN_LOG_LEVEL=2 PYTHONUNBUFFERED=1
echo "ready after $(($(date +%s) - t0)) s"
{ nproc; lscpu; cat /proc/loadavg; uname -a
  python3 -c 'import os; print("affinity", sorted(os.sched_getaffinity(0)))'
  python3 -c 'import tensorflow as tf, keras; print("tf", tf.__version__, "keras", keras.__version__)'
} >"$out/machine.txt" 2>&1
echo "scaling curve (workers $workers, variants $variants, $rounds round(s)), $(left) s left"
timeout $(($(left) - 10)) python3 -m experiments.bench_multiworker --scaling_only --models=conv \
  --workers="$workers" --rounds="$rounds" --input=per_worker --variants="$variants" \
  --control_idle_ms="$idle_ms" --out="$out/scaling.json" 2>&1 | grep -v "^scaling_conv" \
  | tee "$out/scaling.log"
echo "done, $(left) s left"
cat /proc/loadavg
