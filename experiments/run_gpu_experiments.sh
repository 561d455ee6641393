#!/usr/bin/env bash
# Run every GPU experiment of issue 6 in sequence, each under its own `timeout`, and bundle the
# results. Quick mode fits one device call (< 9 minutes on an H200, typically ~4); full mode is
# meant to be split over calls by naming the scripts.
#
#   experiments/run_gpu_experiments.sh [quick|full] [script ...]
#   experiments/run_gpu_experiments.sh quick                      # all six, reduced sweeps
#   experiments/run_gpu_experiments.sh full bench_prefill         # one script, full sweep
#
# Results are appended to experiments/results/<name>.jsonl; logs go to
# experiments/results/_logs/. When $OUT is set (the device machine) the new results and logs are
# copied there as one tarball plus the summary log. Set PYTHON to choose the interpreter.
set -u
MODE=${1:-quick}
shift || true
case "$MODE" in quick|full) ;; *) echo "usage: $0 [quick|full] [script ...]"; exit 2 ;; esac
cd "$(dirname "$0")/.."
ROOT=$PWD
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
FLAG=""; [ "$MODE" = quick ] && FLAG="--quick"
LOGS=experiments/results/_logs
mkdir -p "$LOGS"
SUMMARY=$LOGS/run_gpu_experiments.log
STAMP=$(mktemp); touch "$STAMP"
: > "$SUMMARY"

# script and its time limit (seconds) in quick / full mode; quick limits add up to 8.5 minutes
declare -A QUICK=([bench_ceilings]=30 [bench_prefill]=150 [bench_decode]=100 [exp_memory]=50
                  [bench_tiles]=80 [exp_hbm]=100 [bench_overhead]=90)
declare -A FULL=([bench_ceilings]=60 [bench_prefill]=540 [bench_decode]=540 [exp_memory]=200
                 [bench_tiles]=450 [exp_hbm]=540 [bench_overhead]=90)
ORDER=(bench_ceilings bench_prefill bench_decode exp_memory bench_tiles exp_hbm bench_overhead)
[ $# -gt 0 ] && ORDER=("$@")

echo "run_gpu_experiments: mode=$MODE scripts=${ORDER[*]} python=$($PY -c 'import sys; print(sys.executable)')" | tee -a "$SUMMARY"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv 2>/dev/null | tee -a "$SUMMARY"
T0=$(date +%s)
for s in "${ORDER[@]}"; do
  if [ "$MODE" = quick ]; then LIMIT=${QUICK[$s]:-120}; else LIMIT=${FULL[$s]:-540}; fi
  t=$(date +%s)
  echo "=== $s $FLAG (timeout ${LIMIT}s)" | tee -a "$SUMMARY"
  timeout --kill-after=15 "$LIMIT" "$PY" "experiments/$s.py" $FLAG > "$LOGS/$s.log" 2>&1
  rc=$?
  tail -n 25 "$LOGS/$s.log" | grep -v '^\s*$' | sed 's/\r/\n/g' | grep -v 'it/s\]$' | tail -n 20
  echo "=== $s rc=$rc $(( $(date +%s) - t ))s$([ $rc = 124 ] && echo ' (TIMED OUT: partial results kept)')" | tee -a "$SUMMARY"
done
echo "run_gpu_experiments: total $(( $(date +%s) - T0 ))s" | tee -a "$SUMMARY"

if [ -n "${OUT:-}" ]; then
  # the device tool returns at most 8 files: one tarball of everything new, plus the summary
  find experiments/results -type f -newer "$STAMP" > "$LOGS/.files"
  tar czf "$OUT/experiments_results.tar.gz" -T "$LOGS/.files" && cp "$SUMMARY" "$OUT/"
  echo "run_gpu_experiments: copied $(wc -l < "$LOGS/.files") files to \$OUT/experiments_results.tar.gz"
fi
rm -f "$STAMP"
