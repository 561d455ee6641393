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
#
# Named only (not in the default set; issue 23, Hopper prefill against FlashAttention-3):
#   bench_prefill_fa3   bench_prefill.py, bf16 (figure 1's dtype) at hd 64/128/256, causal and
#                       not, FA3 beside cupyflash, cuDNN, FA2 and the baseline; quick: S 1k/4k/16k
#                       (the targets' lengths), full: S 512 .. 32k in three interleaved rounds
#                       (bench_prefill.py --rounds 3; 73 s on an H200)
#   ncu_prefill         Nsight Compute, one call of cupyflash and of FA3 per shape (B 2, S 8k,
#                       hd 64/128/256 causal and not; quick: hd 64/128 not causal)
#   bench_power         bench_power.py: each impl back to back for 2 s while nvidia-smi samples
#                       the SM clock, power and throttle reasons (quick: hd128 S 16k; full:
#                       hd 64/128/256, S 4k and 16k, causal and not, three rounds; ~250 s)
#   bench_backward      bench_backward.py: forward + backward of cupyflash (autograd and
#                       flash_attn_backward alone, deterministic or not) beside torch SDPA cuDNN,
#                       FA2 and FlexAttention (torch.compile), bf16, hd 64/128/256, causal and not;
#                       quick: S 1k/4k (~5 min, mostly Flex compiles), full: S 512 .. 32k, which
#                       needs ~15-20 min: give each head dim its own device call instead:
#   bench_backward_hd64, bench_backward_hd128, bench_backward_hd256
#                       the same for one head dim (quick: ~2 min; full: ~5-7 min each)
#   train_llama         train_llama.py: a 6-layer Llama (hidden 512, GQA 8/2 x 64, bf16) trained
#                       from the same weights on the same batches with SDPA, cupyflash ("cupyfa")
#                       and a second SDPA backend (the noise floor); quick: 30 steps, full: 300
#                       (estimated 1-3 min on an H200, not yet measured); needs transformers
#   bench_hf_generate   bench_hf_generate.py: HF generate() on 8 left-padded prompts of mixed
#                       lengths (a config-built Llama, bf16), tokens/s, prefill and decode-step
#                       times of cupyflash (both padded decode kernels), SDPA and
#                       flash_attention_2 (if flash_attn imports); quick: 4 layers, prompts up to
#                       256, 32 tokens; full: 16 layers, 1k, 128 (not yet measured); needs
#                       transformers
#   experiments/run_gpu_experiments.sh quick bench_prefill_fa3 ncu_prefill   # limits 200 + 120 s
#   experiments/run_gpu_experiments.sh full ncu_prefill                      # limit 235 s
#
# FlashAttention-3 is the wheel in ../shared/peers/wheels/ (../shared/peers/README.md): the device
# machine cannot download it, so carry it. Before the call, in the checkout:
#   mkdir -p .peers && cp ../shared/peers/wheels/*.whl .peers/      (.peers/ is git-ignored)
# and give the device call carry: [".peers"]. This script then installs it once without an index
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/peers .peers/*.whl
# and appends /tmp/peers to PYTHONPATH (the children keep it: common.run_profiled passes the
# caller's PYTHONPATH on under ncu). Without the wheel the FA3 rows are skipped, and the summary
# says so. Give the run its commit: CUPYFLASH_COMMIT=<full sha> (experiments/NOTES.md).
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
                  [bench_tiles]=80 [exp_hbm]=100 [bench_overhead]=90
                  [bench_prefill_fa3]=200 [ncu_prefill]=120 [bench_power]=60
                  [bench_backward]=540 [bench_backward_hd64]=240 [bench_backward_hd128]=240
                  [bench_backward_hd256]=240 [train_llama]=240 [bench_hf_generate]=240)
declare -A FULL=([bench_ceilings]=60 [bench_prefill]=540 [bench_decode]=540 [exp_memory]=200
                 [bench_tiles]=450 [exp_hbm]=540 [bench_overhead]=90
                 [bench_prefill_fa3]=240 [ncu_prefill]=235 [bench_power]=400
                 [bench_backward]=570 [bench_backward_hd64]=570 [bench_backward_hd128]=570
                 [bench_backward_hd256]=570 [train_llama]=540 [bench_hf_generate]=540)
# entries that run another script with arguments of their own (after $FLAG)
declare -A SCRIPT=([bench_prefill_fa3]=bench_prefill [bench_backward_hd64]=bench_backward
                   [bench_backward_hd128]=bench_backward [bench_backward_hd256]=bench_backward)
# arguments in both modes, and in full mode only
declare -A ARGS=([bench_backward_hd64]="--headdims 64" [bench_backward_hd128]="--headdims 128"
                 [bench_backward_hd256]="--headdims 256")
declare -A ARGS_FULL=([bench_prefill_fa3]="--dtypes bfloat16 --rounds 3")
ORDER=(bench_ceilings bench_prefill bench_decode exp_memory bench_tiles exp_hbm bench_overhead)
[ $# -gt 0 ] && ORDER=("$@")
for s in "${ORDER[@]}"; do
  [ -f "experiments/${SCRIPT[$s]:-$s}.py" ] || { echo "$0: no experiments/${SCRIPT[$s]:-$s}.py for '$s'"; exit 2; }
done

# FlashAttention-3 from carried wheels (see the header), once per machine
[ -d /tmp/peers ] && export PYTHONPATH="$PYTHONPATH:/tmp/peers"
if ls .peers/*.whl >/dev/null 2>&1 && ! "$PY" -c 'import fa3_fwd_interface' >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/peers .peers/*.whl \
    && case ":$PYTHONPATH:" in *:/tmp/peers:*) ;; *) export PYTHONPATH="$PYTHONPATH:/tmp/peers" ;; esac
fi
FA3=$("$PY" -c 'import fa3_fwd_interface as m; print("imports from", m.__file__)' 2>&1 | tail -n 1)

echo "run_gpu_experiments: mode=$MODE scripts=${ORDER[*]} python=$($PY -c 'import sys; print(sys.executable)')" | tee -a "$SUMMARY"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv 2>/dev/null | tee -a "$SUMMARY"
echo "fa3_fwd_interface: $FA3" | tee -a "$SUMMARY"
T0=$(date +%s)
for s in "${ORDER[@]}"; do
  if [ "$MODE" = quick ]; then LIMIT=${QUICK[$s]:-120}; else LIMIT=${FULL[$s]:-540}; fi
  t=$(date +%s)
  EXTRA=${ARGS[$s]:-}; [ "$MODE" = full ] && EXTRA="$EXTRA ${ARGS_FULL[$s]:-}"
  echo "=== $s: ${SCRIPT[$s]:-$s}.py $FLAG $EXTRA (timeout ${LIMIT}s)" | tee -a "$SUMMARY"
  # shellcheck disable=SC2086
  timeout --kill-after=15 "$LIMIT" "$PY" "experiments/${SCRIPT[$s]:-$s}.py" $FLAG $EXTRA > "$LOGS/$s.log" 2>&1
  rc=$?
  tail -n 25 "$LOGS/$s.log" | grep -v '^\s*$' | sed 's/\r/\n/g' | grep -v 'it/s\]$' | tail -n 20
  echo "=== $s rc=$rc $(( $(date +%s) - t ))s$([ $rc = 124 ] && echo ' (TIMED OUT: partial results kept)')" | tee -a "$SUMMARY"
done
echo "run_gpu_experiments: total $(( $(date +%s) - T0 ))s" | tee -a "$SUMMARY"

if [ -n "${OUT:-}" ]; then
  # the device tool returns at most 8 files: one tarball of everything new, plus the summary.
  # A second invocation in the same call (say quick for one script, full for another) writes
  # experiments_results_2.tar.gz, ... and appends its summary to the same log.
  find experiments/results -type f -newer "$STAMP" > "$LOGS/.files"
  TAR="$OUT/experiments_results.tar.gz"; n=2
  while [ -e "$TAR" ]; do TAR="$OUT/experiments_results_$n.tar.gz"; n=$((n + 1)); done
  tar czf "$TAR" -T "$LOGS/.files" && cat "$SUMMARY" >> "$OUT/run_gpu_experiments.log"
  echo "run_gpu_experiments: copied $(wc -l < "$LOGS/.files") files to \$OUT/$(basename "$TAR")"
fi
rm -f "$STAMP"
