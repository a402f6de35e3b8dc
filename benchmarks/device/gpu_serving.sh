#!/usr/bin/env bash
# Serving on a two-GPU host (run from the tree's root there, after bundle.sh and
# make_model_dir.py here; see benchmarks/RESULTS.md for how the device tool carries them):
#   1. the machine: GPUs, their link, GPU-to-GPU copy bandwidth
#   2. the GPU engine tests (pytest -m gpu tests/gpu/test_engine_gpu.py)
#   3. serve_disagg_vs_agg.py with the default model's shape (dummy weights) on the GPUs:
#      aggregated (one GPU), two aggregated replicas (one GPU each), disaggregated with NIXL
#      (prefill on GPU 0, decode on GPU 1) and with the gRPC transfer
#   4. "kv": KV transfer GPU 0 -> GPU 1, NIXL against the peer copy (bench_kv_transfer.py): the
#      default model's 256 KiB blocks and Llama-3.1-8B's 2 MiB blocks, scattered and contiguous,
#      and the 2 MiB scattered case again without the poll's spin
#   5. "goodput": serve_goodput.py on the Llama-3.1-8B shape (dummy weights, the default model's
#      tokenizer; make_model_dir.py --shape): 4,000-token prompts, 200 output tokens, Poisson
#      rates, disaggregated (NIXL) against two aggregated replicas
#   6. "tp": tensor parallelism on the two GPUs: tests/gpu/test_tensor_parallel_gpu.py, then
#      device/tp_probe.py on Llama-3.1-8B's shape at 2 and 1 GPUs and Llama-3.1-70B's at 2
#      (TP_PROBES picks among llama2 llama70b llama1), then baton serve -tp 2 answering one
#      completion (TP_SERVE=0 skips it)
#   7. "tpdisagg": tests/gpu/test_disagg_gpu.py's tensor-parallel disaggregation (prefill and
#      decode workers split across the two GPUs, 2->2, 2->1, 1->2)
#   8. "kvsize": KV transfer of Llama-3.1-8B's 2 MiB blocks at 1 to 1,024 blocks per pull, a
#      READ cut into descriptors of KVSIZE_SPLITS MiB, and UCX settings (KVSIZE_ENVS: --env
#      arguments, one variant each); the copy both ways as the ceiling
# Output under ${OUT:-benchmarks/out/device}.
#
#     bash benchmarks/device/gpu_serving.sh [STAGES]   (default: "machine tests serve")
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-benchmarks/out/device}
mkdir -p "$out"
source benchmarks/device/setup.sh || exit 1
stages=${1:-machine tests serve}
model=${MODEL_DIR:-.gpu/smollm2-shape}

if [[ " $stages " == *" machine "* ]]; then
    nvidia-smi topo -m
    python3 - <<'PY'
import time, torch
n = torch.cuda.device_count()
print("GPUs:", n, [torch.cuda.get_device_name(i) for i in range(n)])
import nixl, fastapi, grpc, google.protobuf as pb
print("nixl", nixl.__file__, "grpc", grpc.__version__, "protobuf", pb.__version__)
if n >= 2:
    print("peer access 0->1:", torch.cuda.can_device_access_peer(0, 1))
    for size in (64 << 20, 1 << 30):
        a = torch.empty(size, dtype=torch.uint8, device="cuda:0")
        b = torch.empty(size, dtype=torch.uint8, device="cuda:1")
        for _ in range(3):
            b.copy_(a)
        torch.cuda.synchronize(0); torch.cuda.synchronize(1)
        reps = 10
        t = time.perf_counter()
        for _ in range(reps):
            b.copy_(a)
        torch.cuda.synchronize(0); torch.cuda.synchronize(1)
        dt = (time.perf_counter() - t) / reps
        print(f"GPU0->GPU1 copy {size >> 20} MiB: {size / dt / 1e9:.1f} GB/s")
PY
fi

if [[ " $stages " == *" tests "* ]]; then
    BATON_TEST_MODEL=$model timeout ${TESTS_TIMEOUT:-420} python3 -m pytest -m gpu -q -x \
        -p no:cacheprovider ${TESTS:-tests/gpu/test_engine_gpu.py tests/gpu/test_disagg_gpu.py} \
        2>&1 | grep -v 'NIXL INFO' | tail -15
fi

if [[ " $stages " == *" serve "* ]]; then
    timeout ${SERVE_TIMEOUT:-420} python3 benchmarks/serve_disagg_vs_agg.py --model "$model" \
        --serve-args "--device cuda --gpus 0,1 --load-format dummy" \
        --modes ${MODES:-aggregated,aggregated+dec2,nixl,grpc} \
        --num-alone 4 --num-long ${NUM_LONG:-16} --num-short ${NUM_SHORT:-48} \
        --max-concurrency ${CONC:-8} --output-len ${OUT_LEN:-128} --max-model-len 8192 \
        --ready-timeout 240 --log-dir "$out/logs" --output-json "$out/disagg_vs_agg.json" \
        2>&1 | grep -v 'NIXL INFO'
fi

if [[ " $stages " == *" kv "* ]]; then
    kv() { timeout 120 python3 benchmarks/bench_kv_transfer.py --devices cuda:0,cuda:1 --reps 7 \
        --modes nixl,copy "$@" 2>&1 | grep -v 'NIXL INFO' | tail -6; }
    kv --layers 4
    kv --layers 4 --contiguous
    kv --layers 32
    kv --layers 32 --contiguous
    kv --layers 32 --spin-ms 0
fi

if [[ " $stages " == *" goodput "* ]]; then
    timeout ${GOODPUT_TIMEOUT:-540} python3 benchmarks/serve_goodput.py \
        --model "${GOODPUT_MODEL:-.gpu/llama8b-shape}" \
        --serve-args "--device cuda --gpus 0,1 --load-format dummy" \
        --modes ${GOODPUT_MODES:-nixl,aggregated+dec2} --rates ${RATES:-2,4,6,8,10,12,14,16,20} \
        --input-len 4000 --output-len 200 --seconds-per-rate ${SECONDS_PER_RATE:-6} \
        --min-requests ${MIN_REQUESTS:-20} --max-model-len 8192 --ready-timeout 240 \
        --log-dir "$out/goodput-logs" --output-json "$out/goodput.json" 2>&1 | grep -v 'NIXL INFO'
fi

if [[ " $stages " == *" tp "* ]]; then
    BATON_TEST_MODEL=$model timeout 200 python3 -m pytest -m gpu -q -x -p no:cacheprovider \
        tests/gpu/test_tensor_parallel_gpu.py 2>&1 | tail -15
    probe() { local log="$out/tp_probe_$1.log"; shift; timeout "$@" > "$log" 2>&1; local rc=$?
        grep -E " tp=|shut down" "$log" || tail -25 "$log"; return $rc; }
    args="--num-prompts 64 --batch 64 --prompt-len 512 --output-len 256"
    probes=${TP_PROBES:-llama2 llama70b llama1}
    [[ $probes == *llama2* ]] &&
        probe llama2 200 python3 benchmarks/device/tp_probe.py --shape llama --tp 2 $args
    [[ $probes == *llama70b* ]] &&
        probe llama70b 240 python3 benchmarks/device/tp_probe.py --shape llama70b --tp 2 $args
    [[ $probes == *llama1* ]] &&
        probe llama1 120 python3 benchmarks/device/tp_probe.py --shape llama --tp 1 $args
    # baton serve -tp 2 on the two GPUs: one decode worker holding both, one completion
    if [[ ${TP_SERVE:-1} == 1 ]]; then
        python3 -m baton.cli serve .gpu/llama8b-shape --load-format dummy --device cuda -tp 2 \
            --gpus 0,1 --port 8123 --max-model-len 4096 > "$out/tp_serve.log" 2>&1 &
        pid=$!
        for _ in $(seq 120); do curl -sf localhost:8123/health > /dev/null && break; sleep 1; done
        ps -eo pid,args | grep -E "baton|tp-rank" | grep -v grep | cut -c1-150
        name=$(curl -s localhost:8123/v1/models | python3 -c "import json,sys; print(json.load(sys.stdin)['data'][0]['id'])")
        curl -s localhost:8123/v1/completions -H 'Content-Type: application/json' \
            -d '{"model": "'"$name"'", "prompt": "Hello", "max_tokens": 8, "temperature": 0}'
        echo; kill -TERM $pid; s=$SECONDS; wait $pid; echo "serve exited $? after $((SECONDS - s)) s"
        grep -iE "error|warn" "$out/tp_serve.log" | head -5
        ps -eo pid,args | grep -E "baton|tp-rank" | grep -v grep | cut -c1-150
    fi
fi

if [[ " $stages " == *" tpdisagg "* ]]; then
    BATON_TEST_MODEL=$model timeout ${TPDISAGG_TIMEOUT:-400} python3 -m pytest -m gpu -q -x \
        -p no:cacheprovider tests/gpu/test_disagg_gpu.py -k tensor_parallel 2>&1 \
        | grep -v 'NIXL INFO' | tail -15
fi

if [[ " $stages " == *" kvsize "* ]]; then
    kvs() { timeout 150 python3 benchmarks/bench_kv_transfer.py --devices cuda:0,cuda:1 \
        --reps 7 --layers 32 --modes nixl,copy,copy-pull "$@" 2>&1 | grep -v 'NIXL INFO' \
        | tail -7; }
    for n in ${KVSIZE_BLOCKS:-1 16 256 1024}; do kvs --contiguous --blocks $n; done
    kvs
    # one READ's runs cut into descriptors of at most M MiB (UCX may copy them side by side)
    for m in ${KVSIZE_SPLITS:-128 32 8}; do kvs --contiguous --max-run-mib $m; done
    for e in ${KVSIZE_ENVS:-UCX_CUDA_IPC_MAX_STREAMS=1}; do
        echo "with $e"; kvs --contiguous --env "$e"
    done
fi
