#!/usr/bin/env bash
# The device check, in one prepared run on a machine with an NVIDIA GPU (issue 54 item 5):
# builds pymoecache with CUDA (or uses the build in $GPU_CHECK_PREFIX), then measures decode
# against stock llama.cpp (llama_cpp.Llama on the same library) with scripts/bench_residency.py:
#   - every layer and expert on the GPU: stock, and ours with the cache counting (residency none,
#     top-k: llama.cpp's selection kept on the GPU and fused into ggml-cuda's top-k MoE kernel as
#     stock's is, the counting's inputs computed into a staging buffer read once per token);
#   - a quarter of the experts cached, streamed, the dense part on the GPU: top-k and prior:0.5,
#     beside --cpu-moe placement (every expert in RAM);
#   - scripts/bench_device.py: llama_decode, and eval + sample, per token of stock, ours (device path,
#     top-k and the prior as GPU ops) and ours through the CPU routing op, in one process;
#   - scripts/bench_vram_share.py: every expert in RAM and a quarter in VRAM against --n-cpu-moe at the
#     same GPU bytes (selections on the GPU, decode tok/s, a 512-token prompt's tok/s), and the tiers
#     exclusive (1/2 in RAM; the device fit's own tier beside no tier);
#     (--unified auto, the default: where the GPU can wrap host memory, a trial of the first 32 decoded tokens
#     picks the direct tier or the round trip, and the row says which);
#   - the same share as the direct tier (--unified on: each token's MoE layers on the GPU alone, routed there,
#     the misses read over the bus from the pinned host slots; bench_device.py --tier prints its graph splits);
#   - scripts/bench_batch_steady.py: serve -np 4 -ngl 99 with a VRAM tier of a quarter, its 4 requests together
#     against one after another in one warm server (the batch's steps through the tier);
#   - the experts in RAM computed by the GPU in place over the bus (--unified on: patches/0004 gives ggml-cuda
#     buffer_from_host_ptr; scripts/check_cuda_patch.py compiles it without a GPU), against --cpu-moe;
#   - the same share with experts twice as wide (3.3 MB): how the ratio to --n-cpu-moe grows where the
#     CPU's expert matmuls weigh more against a layer's fixed costs (the round trip, the routing op);
#   - the CPU alone at the same threads: our expert op on the slots (stream, every expert cached)
#     against ggml's mul_mat_id (resident, stock), which computes the CPU's share of both placements;
#   - low-bit copies (a Q4_K companion) in the host slots and the VRAM tier, against full precision;
# on model C widened to the benchmark size ("trained") and on the synthetic qwen2moe ("random").
# Everything it prints goes to $OUT/gpu_check.txt (or ./gpu_check.txt), tables in Markdown, ending with one
# table of issue 78's rows read from the steps' JSON (scripts/gpu_check_table.py).
#
#   bash scripts/gpu_check.sh                     # build + run (7 minutes on an H200's 16 cores, 3 of them the build)
#   GPU_CHECK_REPS=1 GPU_CHECK_SIZE_MB=600 bash scripts/gpu_check.sh   # shorter
#   GPU_CHECK_STEPS=share,tier bash scripts/gpu_check.sh   # only these steps (a short lease): trained, share,
#                                  # tier (the seeds' scenario's time per token: pinned or not, fill cpu), lowbit,
#                                  # direct (the share, direct tier), batch (-np 4 with the tier), unified (experts read over the bus), device, fusion (device with ggml-cuda's fusion off), wide (share, 3.3 MB
#                                  # experts), cpu (no GPU layers), exclusive, auto, random
#
# On a machine without network: vendor/llama.cpp (or $GPU_CHECK_VENDOR, a copy of it without
# docs, models and tests), and llama-cpp-python, gguf and diskcache on PYTHONPATH, must be there;
# nothing is fetched (-DMOECACHE_VENDOR=OFF). scripts/gpu_carry.sh prepares them here and says how
# to call the device tool with them.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${OUT:-.}
LOG="$OUTDIR/gpu_check.txt"
PREFIX=${GPU_CHECK_PREFIX:-/tmp/pymoecache-cuda}
REPS=${GPU_CHECK_REPS:-3}
SIZE_MB=${GPU_CHECK_SIZE_MB:-1000}
THREADS=${GPU_CHECK_THREADS:-8}
PY=${PYTHON:-python3}
say() { echo "$*" | tee -a "$LOG"; }
: > "$LOG"

# (the sources' digest too: a copy of the tree sent to a lent machine may carry a stale .git)
SRC_DIGEST=$(cat src_cpp/*.h src_cpp/*.cpp patches/*.patch pymoecache/*.py 2>/dev/null | sha256sum | cut -c1-12)
say "# gpu_check $(date -u +%Y-%m-%dT%H:%MZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'), sources $SRC_DIGEST"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | sed 's/^/gpu: /' | tee -a "$LOG"
say "nvcc: $(nvcc --version 2>/dev/null | tail -1); python: $($PY --version 2>&1); cores: $(nproc)"

if [ -n "${GPU_CHECK_VENDOR:-}" ] && [ ! -f vendor/llama.cpp/CMakeLists.txt ]; then
    mkdir -p vendor && cp -r "$GPU_CHECK_VENDOR" vendor/llama.cpp
fi
if [ ! -f "$PREFIX/pymoecache/__init__.py" ]; then
    t0=$(date +%s)
    say "building with CUDA into $PREFIX"
    CMAKE_ARGS="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90} -DGGML_CUDA_FA=OFF -DMOECACHE_VENDOR=OFF -DGGML_NATIVE=ON" \
    CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
        "$PY" -m pip install -q --no-build-isolation --no-deps --no-compile --target "$PREFIX" . > "$OUTDIR/build.log" 2>&1
    rc=$?
    say "build: exit $rc in $(( $(date +%s) - t0 )) s"
    if [ $rc -ne 0 ]; then
        tail -40 "$OUTDIR/build.log" | tee -a "$LOG"
        exit 1
    fi
fi
export PYTHONPATH="$PREFIX${PYTHONPATH:+:$PYTHONPATH}"
(cd /tmp && "$PY" -c "import pymoecache, llama_cpp; print('pymoecache from', pymoecache.__file__)") 2>&1 | tee -a "$LOG"

step() { # whether GPU_CHECK_STEPS (a comma-separated list; unset: every step) asks for step $1
    [ -z "${GPU_CHECK_STEPS:-}" ] || [[ ",$GPU_CHECK_STEPS," == *",$1,"* ]]
}
share() { # a titled bench_vram_share run into the log
    local title=$1; shift
    say ""
    say "## $title"
    say "\`python scripts/bench_vram_share.py $*\`"
    "$PY" scripts/bench_vram_share.py "$@" 2>&1 | grep -v "^llama_context\|n_ctx_seq\|^ggml_cuda_init\|^  Device 0" | tee -a "$LOG"
}

bench() { # a titled bench_residency run; its table and ratios into the log
    local title=$1; shift
    say ""
    say "## $title"
    say "\`python scripts/bench_residency.py $*\`"
    local t0=$(date +%s)
    "$PY" scripts/bench_residency.py "$@" > "$OUTDIR/bench.out" 2> "$OUTDIR/bench.err"
    local rc=$?
    cat "$OUTDIR/bench.out" >> "$LOG"
    grep "^\[rep" "$OUTDIR/bench.err" >> "$LOG"
    [ $rc -ne 0 ] && tail -20 "$OUTDIR/bench.err" | tee -a "$LOG"
    say "(exit $rc, $(( $(date +%s) - t0 )) s)"
}

COMMON="--gpu-layers 99 --stock --cpu-moe --no-mmap --cache-sizes 0.25 --routings lru,prior:0.5 --reps $REPS --threads $THREADS --tokens 64 --warmup 8 --keep-going"
# the acceptance rows first (a run cut short by the time limit keeps them): every expert on the GPU against
# stock, a quarter of the experts' bytes in VRAM against --n-cpu-moe, low-bit copies on the GPU
step trained && bench "model C widened (trained), every layer on the GPU" --model trained $COMMON
BENCH_TRAINED=$("$PY" -c "import sys; sys.path.insert(0, 'scripts'); import bench_residency as b; print(b.trained_bench_model())" | tail -1)
step share && share "every expert in RAM, a quarter in VRAM: decode tok/s against stock --n-cpu-moe at the same GPU bytes (model C widened; goal >= 1.5x)" \
    --model "$BENCH_TRAINED" --rpc none --speed --reps "$REPS" --tokens 128 --prompt 512 --threads "$THREADS" --timeline \
    --json "$OUTDIR/share.json"
step direct && share "the same share, the direct tier (--unified on: each token's MoE layers on the GPU alone, the misses read over the bus from pinned RAM; patches/0004) (model C widened; goal >= 1.5x)" \
    --model "$BENCH_TRAINED" --rpc none --unified on --speed --reps "$REPS" --tokens 128 --prompt 512 --threads "$THREADS" --timeline \
    --json "$OUTDIR/direct.json"
if step tier; then
    GGML_CUDA_NO_PINNED=1 share "the same, the host slots pageable (GGML_CUDA_NO_PINNED=1: copies up staged by the driver)" \
        --model "$BENCH_TRAINED" --rpc none --speed --reps "$REPS" --tokens 128 --threads "$THREADS" --timeline
    share "the same, --vram-fill cpu (no copies up once the tier is full)" \
        --model "$BENCH_TRAINED" --rpc none --speed --reps "$REPS" --tokens 128 --threads "$THREADS" --timeline --vram-fill cpu
fi
if step batch; then
say ""
say "## serve -np 4 -ngl 99 with a VRAM tier of a quarter (8 of 32): 4 requests together against one after another (model C widened)"
say "\`python scripts/bench_batch_steady.py --np 4 --routings lru,default --tokens 64 --reps $REPS -t $THREADS --serve-args \"-ngl 99 --vram-size 8\"\`"
"$PY" scripts/bench_batch_steady.py --np 4 --routings lru,default --tokens 64 --reps "$REPS" -t "$THREADS" \
    --serve-args "-ngl 99 --vram-size 8" --json "$OUTDIR/batch.json" 2>&1 | grep -v "^llama_context\|n_ctx_seq" | tee -a "$LOG"
fi
step unified && bench "experts in RAM computed by the GPU in place over the bus (--unified on, patches/0004), against --cpu-moe (model C widened)" \
    --model trained --gpu-layers 99 --stock --cpu-moe --no-mmap --cache-sizes 0.25,1.0 --routings lru --unified on \
    --reps "$REPS" --threads "$THREADS" --tokens 64 --warmup 8 --keep-going
if step wide; then
    BENCH_WIDE=$("$PY" -c "import sys; sys.path.insert(0, 'scripts'); import bench_residency as b; print(b.trained_bench_model(4096))" | tail -1)
    share "the same share with experts twice as wide (model C widened to 4096: 3.3 MB a Q8_0 expert)" \
        --model "$BENCH_WIDE" --rpc none --speed --reps "$REPS" --tokens 128 --threads "$THREADS" --timeline
fi
step lowbit && bench "low-bit copies on the GPU: a Q4_K companion in the host slots and the VRAM tier (model C widened)" --model trained \
    --gpu-layers 99 --stock --no-mmap --cache-sizes 0.25 --routings prior:0.5 --prefetch off,off:m=lowbit-cache \
    --vram-size 8 --vram-fill copy --reps "$REPS" --threads "$THREADS" --tokens 64 --warmup 8 --keep-going
if step device; then
say ""
say "## where a token's time goes, every layer on the GPU (model C widened)"
say "\`python scripts/bench_device.py --model $BENCH_TRAINED --tokens 256 --rounds 5 --threads $THREADS --tier 8\`"
"$PY" scripts/bench_device.py --model "$BENCH_TRAINED" --tokens 256 --rounds 5 --threads "$THREADS" --tier 8 \
    --json "$OUTDIR/device.json" 2>&1 \
    | grep -v "^llama_context\|n_ctx_seq" | tee -a "$LOG"
fi
if step fusion; then
say ""
say "## the same with ggml-cuda's fusion off (GGML_CUDA_DISABLE_FUSION=1): what the fused top-k MoE kernel gives stock, and ours"
say "\`GGML_CUDA_DISABLE_FUSION=1 python scripts/bench_device.py --model $BENCH_TRAINED --tokens 256 --rounds 3 --threads $THREADS\`"
GGML_CUDA_DISABLE_FUSION=1 "$PY" scripts/bench_device.py --model "$BENCH_TRAINED" --tokens 256 --rounds 3 --threads "$THREADS" 2>&1 \
    | grep -v "^llama_context\|n_ctx_seq" | tee -a "$LOG"
fi
step cpu && bench "the CPU alone, $THREADS threads: our expert op on the slots (stream, every expert cached) against ggml's (resident, stock) (model C widened)" \
    --model trained --gpu-layers 0 --stock --no-mmap --cache-sizes 1.0 --routings lru --reps "$REPS" --threads "$THREADS" \
    --tokens 64 --warmup 8 --keep-going
step exclusive && share "exclusive tiers: 1/2 of the experts in RAM, 1/4 in VRAM, and -ngl 99 --cache-size 16 alone (the GPU's free memory takes the rest) against no tier (model C)" \
    --model models/tiny-shakespeare-qwen2moe-32x4-w256.gguf --rpc none --host-share 0.5 --exclusive --device-fit \
    --warmup 512 --tokens 256 --speed --reps 2 --threads "$THREADS" --timeline
if step auto; then
say ""
say "## -ngl auto: what the GPU reports free, and the layers and experts placed for it (model C widened)"
"$PY" -c "from pymoecache import plan; print('device_free_memory:', plan.device_free_memory())" 2>&1 | tee -a "$LOG"
"$PY" -m pymoecache info "$BENCH_TRAINED" -c 256 2>&1 | sed -n '/^GPU layers on/,/^$/p' | tee -a "$LOG"  # (its plan, before a load)
"$PY" -m pymoecache run -m "$BENCH_TRAINED" -p "ROMEO:" -n 16 -ngl auto -v 2>&1 | grep "offloaded\|^plan:\|warning" \
    | tee -a "$LOG"
# the widest experts the shapes have (mixtral-8x7b's, 102 MiB each; 4 layers to spare the disk and the time), on a GPU
# held to 2.5 GiB free: -ngl 99 alone sizes the tier to what is left (--vram-size auto), and its trial picks direct or
# the round trip
WIDE=$("$PY" scripts/real_size.py mixtral-8x7b --layers 4 | tail -1)
say ""
say "## -ngl 99 alone on $(basename "$WIDE") (mixtral-8x7b's shape, 4 layers), the GPU held to 2.5 GiB free (scripts/hold_vram.py)"
"$PY" scripts/hold_vram.py --leave-gib 2.5 < <(sleep 600) > "$OUTDIR/hold.out" 2>&1 &
HOLD=$!
for _ in $(seq 60); do grep -q "holding\|^hold_vram: " "$OUTDIR/hold.out" && break; sleep 1; done
tee -a "$LOG" < "$OUTDIR/hold.out"
"$PY" -m pymoecache run -m "$WIDE" -p "The" -n 64 -c 4096 -ngl 99 -v 2>&1 \
    | grep "offloaded\|^plan:\|warning\|direct tier\|stay on the CPU\|tok/s" | cut -c1-600 | tee -a "$LOG"
kill "$HOLD" 2>/dev/null
fi
step random && bench "synthetic qwen2moe, ${SIZE_MB} MB (random), every layer on the GPU" --model random --size-mb "$SIZE_MB" $COMMON
say ""
say "## the table (issue 78's rows, from the steps above)"
"$PY" scripts/gpu_check_table.py "$OUTDIR" 2>&1 | tee -a "$LOG"
say ""
say "done: $LOG"
