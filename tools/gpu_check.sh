#!/usr/bin/env bash
# Everything that a GPU changes, checked in one command: run it from the repository's root.
#
#     bash tools/gpu_check.sh OUT_DIR          on a machine with a CUDA GPU (a few minutes on an H200)
#     bash tools/gpu_check.sh OUT_DIR --cpu    the same steps on the CPU with tiny models, as the tests run it
#
# Each step's output goes to OUT_DIR/NAME.txt, and a line per step (ok, FAILED or TIMED OUT, its
# seconds, its output's last line) to the screen at the end and to OUT_DIR/summary.txt. Each step
# has a time limit of its own, so that one hang cannot eat the rest. It needs what requirements.txt
# installs and no network: with no GPT-2 weights at hand, the demo says so and runs random weights.
# PYTHON names the interpreter (default: python3). It needs GNU coreutils' timeout.
set -u
mkdir -p "${1:?usage: bash tools/gpu_check.sh OUT_DIR [--cpu]}" || exit 2
out=$(cd "$1" && pwd)  # before the cd below, so that a relative OUT_DIR means where it was typed
cd "$(dirname "$0")/.." || exit 2
: > "$out/summary.txt"
py=${PYTHON:-python3}

if [ "${2:-}" = --cpu ]; then  # tiny models, few requests: the steps' plumbing, in seconds
  device=(--device cpu) quick=(--quick) slots=(2 4) requests=(--requests 16)
  dtypes=(float32) tests=(-k "summarize or percentile")  # a few tests: the suite itself runs this script
else
  device=(--device cuda) quick=() slots=(8 64) requests=(--requests 256)
  dtypes=(bfloat16 float32) tests=()
fi

step() {  # step NAME SECONDS COMMAND...: run COMMAND, at most SECONDS, its output in OUT_DIR/NAME.txt
  local name=$1 limit=$2 start=$SECONDS status code
  shift 2
  timeout --kill-after=10 "$limit" "$@" > "$out/$name.txt" 2>&1
  code=$?
  case $code in
    0) status=ok ;;
    124) status="TIMED OUT (${limit} s)" ;;
    137) status="KILLED (${limit} s up, or memory)" ;;
    *) status="FAILED (exit $code)" ;;
  esac
  printf '%-30s %-18s %4d s  %s\n' "$name" "$status" $((SECONDS - start)) \
    "$(grep -v '^\s*$' "$out/$name.txt" | tail -n 1 | cut -c 1-100)" >> "$out/summary.txt"
}

# 1) The machine: the GPU, and the versions of torch and CUDA.
step machine 60 bash -c "nvidia-smi 2>&1 | head -n 15; $py -c 'import torch; print(\"torch\", torch.__version__, \
\"CUDA\", torch.version.cuda, [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())])'"
# 2) The tests: here their CUDA cases run (and the two-GPU one, where there are two).
step pytest 300 "$py" -m pytest -q -p no:cacheprovider "${tests[@]}"
# 3) The bench at a few slots and at many, in a 16-bit dtype and in float32.
for n in "${slots[@]}"; do
  for dtype in "${dtypes[@]}"; do
    step "bench-$n-slots-$dtype" 150 "$py" tools/bench.py "${device[@]}" "${quick[@]}" --dtype "$dtype" \
      --slots "$n" "${requests[@]}" --svg "$out/bench-$n-slots-$dtype.svg"
  done
done
# 3b) The paged section on its own (bench --paged): per slot against paged in the same KV memory, at
#     the fewer slots, in the 16-bit dtype on a GPU, where more rows should cost little.
step "bench-paged-${slots[0]}-slots-${dtypes[0]}" 200 "$py" tools/bench.py "${device[@]}" "${quick[@]}" --paged \
  --dtype "${dtypes[0]}" --slots "${slots[0]}" "${requests[@]}"
# 4) The table of decode steps, with an attention call costed at 0, 2,000 and 20,000 keys: what the
#    estimate in model.CALL_COST_IN_KEYS guesses, measured.
for keys in 0 2000 20000; do
  step "decode-steps-cost-$keys" 90 "$py" tools/bench.py "${device[@]}" "${quick[@]}" --dtype bfloat16 \
    --decode-steps --call-cost "$keys"
done
# 5) verify in bfloat16, whole prompts, disaggregated, and paged in a pool of 8 blocks of 16: too few
#    for 8 slots' requests, so that some are preempted and fed again (5 times among --quick's 12 requests,
#    19 among the 16 without).
step verify-bfloat16 150 "$py" tools/verify.py "${device[@]}" "${quick[@]}" --dtype bfloat16
step verify-bfloat16-disaggregated 150 "$py" tools/verify.py "${device[@]}" "${quick[@]}" --dtype bfloat16 \
  --disaggregate
step verify-bfloat16-paged 150 "$py" tools/verify.py "${device[@]}" "${quick[@]}" --dtype bfloat16 --kv-blocks 8
# 5b) Batch invariance on this machine: each op of a step in float32, where a row's bits depend on its batch
#     (default path, batch-invariant path; FAILED if an op of the batch-invariant path varies here), then the
#     batch-invariant engine against the reference, bit for bit, paged too (docs/api.md, "Batch invariance").
step verify-ops-float32 150 "$py" tools/verify.py "${device[@]}" "${quick[@]}" --dtype float32 --ops
step verify-batch-invariant 150 "$py" tools/verify.py "${device[@]}" "${quick[@]}" --dtype float32 --batch-invariant
step verify-batch-invariant-paged 150 "$py" tools/verify.py "${device[@]}" "${quick[@]}" --dtype float32 \
  --batch-invariant --kv-blocks 8
# 6) The demo, quick and full, disaggregated; then paged, 64 slots sharing what 8 slots of 1,024 hold.
step demo-quick-disaggregated 60 "$py" nanobatch.py --demo --quick --disaggregate "${device[@]}"
step demo-disaggregated 120 "$py" nanobatch.py --demo --disaggregate "${device[@]}" "${quick[@]}"
step demo-paged 120 "$py" nanobatch.py --demo --quiet --kv-blocks 512 --slots 64 "${device[@]}" "${quick[@]}"

cat "$out/summary.txt"
! grep -qv '^[^ ]* *ok ' "$out/summary.txt"  # the exit status: 0 only if every step was ok
