# Nsight Compute on one decode step of issue 5's workload, in the engine's state
# (ncu_probe.py): for each of RUNS (default "qwen:256 llama:1"), a table of every kernel of one
# step (duration, DRAM throughput and bytes, SM throughput, grid, registers, warps active;
# ncu_table.py), then the full sections (speed of light, memory, occupancy, launch, scheduler,
# warp stalls) of the kernels matching DETAIL (default: the decode attention, the GEMVs and
# cuBLAS's kernels), the first DETAIL_COUNT (8) of them, with SOURCE=1 also where their warps
# stall, line by line (SourceCounters). Output under $OUT/ncu-*.txt. The twenty-seventh
# session ran RUNS="qwen:256" DETAIL="regex:_decode_kernel" DETAIL_COUNT=2, then
# RUNS="llama:1" NO_DETAIL=1, each with TIMEOUT=160.
# ncu serializes and replays each profiled kernel: the durations are of each kernel alone,
# with the clocks left alone (--clock-control none), caches flushed between passes.
#
#     bash benchmarks/device/ncu_kernels.sh            (carry .whl)
#
# On a CPU: SMOKE=1 runs ncu_probe.py's smoke run without ncu.
if [[ -n "${SMOKE:-}" ]]; then
  python3 benchmarks/device/ncu_probe.py --shape tiny --device cpu --batch 4 --num-prompts 4 \
      --output-len 16 --at 5
  exit
fi
source benchmarks/device/setup.sh || exit 1
OUT=${OUT:-/tmp/ncu-out}
mkdir -p "$OUT"
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
echo "ncu: $NCU ($("$NCU" --version | tail -1))"
DETAIL=${DETAIL:-"regex:_decode_kernel|gemv|gemm|nvjet|sm90|splitK|silu|rms"}
DETAIL_COUNT=${DETAIL_COUNT:-8}
METRICS=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,dram__bytes_read.sum,dram__bytes_write.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__block_size,launch__registers_per_thread,sm__warps_active.avg.pct_of_peak_sustained_active,lts__t_sector_hit_rate.pct
for run in ${RUNS:-qwen:256 llama:1}; do
  shape=${run%%:*}
  batch=${run##*:}
  probe=(python3 benchmarks/device/ncu_probe.py --shape "$shape" --batch "$batch"
         --num-prompts "$batch" --at "${AT:-100}")
  echo "== $shape $batch: every kernel of one step ($(date +%T))"
  timeout "${TIMEOUT:-170}" "$NCU" --clock-control none --profile-from-start off \
      --launch-count 400 --csv --page raw --print-units base --metrics "$METRICS" \
      "${probe[@]}" --steps 1 > "$OUT/ncu-$shape-$batch-step.csv" 2> "$OUT/ncu-$shape-$batch-step.err"
  echo "rc $?"
  pkill -9 -f ncu_probe.py; sleep 1  # a timed-out ncu leaves its target running
  python3 benchmarks/device/ncu_table.py "$OUT/ncu-$shape-$batch-step.csv" || tail -5 "$OUT/ncu-$shape-$batch-step.err"
  [[ -n "${NO_DETAIL:-}" ]] && continue
  echo "== $shape $batch: sections of the first $DETAIL_COUNT kernels matching $DETAIL ($(date +%T))"
  timeout "${TIMEOUT:-170}" "$NCU" --clock-control none --profile-from-start off \
      -k "$DETAIL" --launch-count "$DETAIL_COUNT" \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
      --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats \
      ${SOURCE:+--section SourceCounters --import-source yes} \
      "${probe[@]}" --steps 1 > "$OUT/ncu-$shape-$batch-detail.txt" 2>&1
  echo "rc $?"
  pkill -9 -f ncu_probe.py; sleep 1
  grep -E "^  [a-zA-Z_].*\(|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit|Waves Per SM|L2 Hit|Stall|No Eligible|Issued Warp" \
      "$OUT/ncu-$shape-$batch-detail.txt" | head -120
done
echo "done $(date +%T)"
