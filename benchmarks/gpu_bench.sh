#!/usr/bin/env bash
# The cuda backend on a lent GPU machine, in stages that fit one device call each (the machine
# keeps /tmp between calls made while it is warm). Carry .wheels (the gguf wheel: `pip download
# gguf==0.19.0 --no-deps -d .wheels`) and .peer (`bash ../shared/peers/llamacpp-cuda.sh prepare
# .peer`), both ignored folders. Logs under $OUT. A session's calls, in order: candidates, ab,
# table (each under ten minutes).
#
#   bash benchmarks/gpu_bench.sh check   conformance, the twin comparisons against cpu (and
#                                        with TESTS=1 the kernel and gpu-marked tests), while
#                                        llama.cpp's CUDA build compiles; with TESTS=1 that is
#                                        more than one call holds: COMPARE=0 leaves the
#                                        comparisons to the next call's `compare` stage
#   bash benchmarks/gpu_bench.sh verify  every bit-exactness check at once, as parallel processes
#                                        on the one GPU (cuda and triton conformance, triton's
#                                        fast tier with the float16 products too, the kernel
#                                        and gpu-marked tests, the switches' kernels: the deep
#                                        variants' attention, gemm_mma of 64 tokens), exit 1
#                                        where one failed; a third of `check`'s device time,
#                                        no timings
#   bash benchmarks/gpu_bench.sh compare both twins against cpu (benchmarks/gpu_compare.py:
#                                        prompts 1, 7, 300, 600 x 64 steps, 256 greedy tokens;
#                                        SHORT=1: 1 and 600 x 16, 64 greedy, in parallel)
#   bash benchmarks/gpu_bench.sh bench   parity beside llama.cpp on the twins: decode at depth 0
#                                        and 512, prefill 512, first step, kernels per step
#                                        (LLAMA=0: parity alone; GC_FREEZE=: no gc-freeze probe)
#   bash benchmarks/gpu_bench.sh quick   the kernel tests (every op, the gpu-marked tests),
#                                        conformance, then `bench` with LLAMA=0 and a host profile
#   bash benchmarks/gpu_bench.sh candidates  the lowering's switches that stay off until a GPU
#                                        has timed them (SWITCHES, by default every one):
#                                        conformance with them off and on, the twins against cpu
#                                        with them on (and Gemma 3's off), while llama.cpp builds
#                                        for `table`
#   bash benchmarks/gpu_bench.sh ab      VARIANTS (switches joined by commas; "-": as shipped)
#                                        against each other, ROUNDS (2) rounds alternated, one
#                                        process a variant: the replayed decode step at depth
#                                        POSITION (100), the 512-token prefill, kernel by kernel
#                                        (bench_gpu_steps.py --profile; AB_PREFILL=0: the
#                                        decode step alone), then (PDL_OFF=0: not)
#                                        as shipped and with every switch, the decode kernels'
#                                        own times with PARITY_PDL=0. About 17 s a model and
#                                        variant a round: the default 4 variants take half a call a
#                                        model (MODELS=...). DEEP=1: the deep variants instead
#                                        (flash decoding's switches) at POSITION (4000) in a
#                                        cache of CTX (4352; 16640 for POSITION=16000).
#                                        A variant tree:DIR runs the parity package in DIR
#                                        instead (a change with no switch against the tree
#                                        before it: `git archive HEAD~1 parity | tar -x -C
#                                        .old`, carried; VARIANTS="tree:.old -")
#   bash benchmarks/gpu_bench.sh fast    the fast prefill's VARIANTS (as `ab`'s; default:
#                                        as shipped, the GLU a column a thread, fast
#                                        attention over three blocks) against each other,
#                                        ROUNDS (2) rounds alternated: a PREFILL_N-token
#                                        (512) prefill under numerics = NUMERICS ("fast")
#                                        kernel by kernel, its time between events and its
#                                        ten busiest kernels
#   bash benchmarks/gpu_bench.sh deep    kernel by kernel deep in the cache (decode at 4000 and
#                                        16000, 8000 for SmolLM2) and the 4096-token prefill,
#                                        with PDL on and off (the table's weakest columns)
#   bash benchmarks/gpu_bench.sh half    triton:fast's quantized products on float16 tensor
#                                        cores (PARITY_TRITON_HALF_GEMM=1) against the integer
#                                        dots: fast conformance with it on, then the 512-token
#                                        prefill kernel by kernel, both ways, two rounds
#   bash benchmarks/gpu_bench.sh ncu     hardware counters of a few kernels (Nsight Compute, which
#                                        reads them on Firecracker machines only): where the
#                                        warps stall, occupancy, the busiest units, the hottest
#                                        source lines; NCU_KERNELS (regexes of the demangled
#                                        name, template arguments too: "gemv_q<14"), NCU_MODEL, a
#                                        512-token prefill and 8 decode steps of `parity bench`
#   bash benchmarks/gpu_bench.sh table   the issue's table beside llama.cpp (bench_gpu.py):
#                                        decode at depths 0, 4096 and 16384, prefill 128, 512
#                                        and 4096 (RUNNERS, default cuda:exact and triton:fast;
#                                        a switch per runner: cuda:exact:lowering.NAME=1)
set -u
stage=${1:?usage: gpu_bench.sh check|verify|compare|bench|quick|candidates|ab|fast|deep|half|ncu|table}
out=${OUT:-/tmp/out}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .wheels/*.whl || exit 1
export PYTHONPATH=/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || { echo "install failed"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
# llama.cpp's build from an earlier call, when it came back (PACK=1 below) and travels in .lcpp
if [ ! -x /tmp/lcpp/build/bin/llama-bench ] && ls .lcpp/lcpp-bin.tar.xz.* >/dev/null 2>&1; then
  mkdir -p /tmp/lcpp/build && cat .lcpp/lcpp-bin.tar.xz.* | xz -d | tar xf - -C /tmp/lcpp/build
fi
models=${MODELS:-"smollm2-135m qwen2.5-coder-0.5b gemma3-270m"}
for m in $models; do
  [ -f /tmp/$m.gguf ] || python3 .peer/twin.py .peer/headers/$m.header.bin /tmp/$m.gguf >/dev/null
done
if [ "$stage" = quick ]; then
  echo "== kernel tests"
  timeout 200 python3 -m pytest -q -x --tb=short -p no:cacheprovider tests/test_backend_ops.py \
    --backend cuda 2>&1 | tee "$out/ops_tests.txt" | tail -3
  echo "== parity conformance cuda"
  timeout 150 python3 -m parity conformance cuda 2>&1 | tee "$out/conformance.txt" | tail -3
  echo "== gpu tests"
  timeout 200 python3 -m pytest -q -x --tb=short -p no:cacheprovider tests/test_cuda_backend.py \
    2>&1 | tee "$out/gpu_tests.txt" | tail -3
  for m in $models; do
    timeout 60 python3 benchmarks/bench_gpu_steps.py /tmp/$m.gguf --host-profile 2>&1 | head -40
  done > "$out/host_profile.txt"
  LLAMA=0 bash "$0" bench
  exit 0
fi
# (PREFILL_TILES is on since its A/B; PREFILL_TILES=0 times the kernels it replaced)
# (the switches still to time, sixth session: the head's loads, flash decoding's fold and
# register caps, which matter deep in the cache: POSITION=4000, the norms' block size, and the
# prefill GEMM's blocks a multiprocessor)
# (seventh session: a deep token's chunks by a block a KV head, HEADS_TOGETHER_CHUNKS; not for
# heads of 256 here, where it would turn QUARTER_SUMS off: verify's deep variants check them)
together="HEADS_TOGETHER_CHUNKS[64]=3 HEADS_TOGETHER_CHUNKS[128]=3"
# (eighth session: prefill attention's scores kept for its second pass, TILE_SCORES_BYTES: on
# since its A/B; TILE_SCORES_BYTES=0 times the kernel without)
# (and gemm_mma's blocks of 64 tokens, MMA_TOKENS)
# (ninth session: a prefill's norms a row a warp, NORM_WARP_WIDTH_MAX; gate/up quantizing its
# output for down, MMA_QUANTIZE; Gemma 3's gate, up and GEGLU as one GEMM, MMA_GLU; q, k, v too,
# MMA_MULTI: on since the tenth session's A/B but MMA_QUANTIZE)
# (tenth session: a decode step's norms a row a warp, half a millisecond a step slower in the
# eleventh's A/B: removed)
# (eleventh session: 64-token GEMM blocks for the deep ungated products, MMA_DEEP_K)
# (sixteenth session: the decode norms made by their products, NORM_IN_PRODUCT: slower on an
# H100, off; NORM_AFTER_PRODUCT timed again with its register tail: still slower)
# (twenty-first session: QUARTER_SUMS on; CHUNKS_SLABS_AHEAD lost its A/B, off)
switches=${SWITCHES:-"NORM_IN_PRODUCT=1 MMA_DEEP_K=4096 MMA_TOKENS=64 MMA_QUANTIZE=1 WIDE_FIT_ROW=1 FOLD_BATCH=8 CHUNKS_MIN_BLOCKS=2 SUMS_MIN_BLOCKS=2 NORM_DECODE_THREADS=128 MMA_MIN_BLOCKS=3 ARGMAX_IN_HEAD=1 CHUNKS_SLABS_AHEAD=1 $together"}
all=${switches// /,}
if [ "${DEEP:-0}" = 1 ]; then  # flash decoding's switches, deep in the cache
  fold=FOLD_BATCH=8; caps=CHUNKS_MIN_BLOCKS=2,SUMS_MIN_BLOCKS=2
  all3="HEADS_TOGETHER_CHUNKS[64]=3,HEADS_TOGETHER_CHUNKS[256]=1"  # every deep token
  from16="HEADS_TOGETHER_CHUNKS[64]=16,HEADS_TOGETHER_CHUNKS[256]=16"  # from depth 4,096
  # (eighth session, H100: FOLD_BATCH=8 slower at 4,000 and 16,000; the heads together with
  # it 0.15 ms faster than it alone at 16,000, alone not yet timed)
  variants=${VARIANTS:-"- $all3 $from16 $caps $caps,$all3 $fold,$all3"}
  POSITION=${POSITION:-4000}
else
  # (tenth session, H100, one switch a variant: the prefill's norms, q/k/v and Gemma 3's GLU
  # adopted, docs/perf.md; eleventh: the decode norms a row a warp, the GEMM's 64-token blocks
  # by type and the decode norms' block of 256 threads all lost; fifteenth: the blocks by depth
  # won, MMA_DEEP_K=4096 shipped)
  variants=${VARIANTS:-"- MMA_DEEP_K=0"}
fi
if [ "$stage" = candidates ]; then
  (bash .peer/llamacpp-cuda.sh build > /tmp/lcpp_build.txt 2>&1; echo "build rc $?" >> /tmp/lcpp_build.txt) &
  build=$!
  echo "== parity conformance cuda"
  timeout 200 python3 -m parity conformance cuda 2>&1 | tee "$out/conformance.txt" | tail -3
  echo "== parity conformance cuda with $switches"
  timeout 200 python3 benchmarks/with_lowering.py $switches -- -m parity conformance cuda 2>&1 \
    | tee "$out/conformance_switches.txt" | tail -3
  echo "== parity conformance cuda -k matmul -k argmax, every one-token product of 528 rows or more wide"
  for fit in 0 1; do  # (on an H200 only the 40,009-row head case reaches gemv_q_wide otherwise)
    timeout 100 python3 benchmarks/with_lowering.py WIDE_MIN_ROWS=1 WIDE_BLOCKS_PER_SM=1 \
      WIDE_FIT_ROW=$fit ARGMAX_IN_HEAD=$fit -- -m parity conformance cuda -k matmul -k argmax \
      2>&1 | tail -1
  done
  for m in $models; do
    echo "== compare cpu,cuda $m with $switches"
    timeout 100 python3 benchmarks/with_lowering.py $switches -- benchmarks/gpu_compare.py \
      /tmp/$m.gguf --prompts 7,600 --steps 32 --greedy 32 2>&1 | tee -a "$out/compare.txt" | tail -4
  done
  echo "== compare cpu,cuda gemma3-270m as shipped"
  timeout 100 python3 benchmarks/gpu_compare.py /tmp/gemma3-270m.gguf --prompts 1,600 --steps 32 \
    --greedy 32 2>&1 | tee -a "$out/compare.txt" | tail -4
  wait $build; cp /tmp/lcpp_build.txt "$out/"; tail -1 /tmp/lcpp_build.txt
  exit 0
fi
if [ "$stage" = ab ]; then  # (about 17 s a model and variant a round: MODELS=one a call)
  # the deep variants' kernels bit-exact first (CONFORM=0: `verify` did)
  if [ "${DEEP:-0}" = 1 ] && [ "${CONFORM:-1}" = 1 ]; then
    for variant in $variants; do
      [[ $variant == - || $variant == tree:* ]] && continue
      echo "== parity conformance cuda -k attention with $variant"
      timeout 100 python3 benchmarks/with_lowering.py ${variant//,/ } -- -m parity conformance \
        cuda -k attention 2>&1 | tail -1
    done 2>&1 | tee "$out/conformance_deep.txt"
  fi
  for round in $(seq "${ROUNDS:-2}"); do
    for m in $models; do
      for variant in $variants; do
        echo "== round $round $m $variant"
        [ "$variant" = - ] && variant=
        tree=/tmp/site  # (tree:DIR: DIR's package first on the path, no switch)
        [[ $variant == tree:* ]] && tree=${variant#tree:}:/tmp/site && variant=
        PYTHONPATH=$tree timeout 60 python3 benchmarks/with_lowering.py ${variant//,/ } -- \
          benchmarks/bench_gpu_steps.py /tmp/$m.gguf --ctx "${CTX:-4352}" --position "${POSITION:-100}" --runs 100 \
          --prefill "${AB_PREFILL:-512}" --profile 2>&1 | tail -4
      done
    done
  done 2>&1 | tee "$out/ab.txt"
  [ "${PDL_OFF:-1}" = 0 ] && exit 0
  for m in $models; do
    for variant in - "$all"; do
      echo "== PDL off: $m $variant"
      [ "$variant" = - ] && variant=
      PARITY_PDL=0 timeout 60 python3 benchmarks/with_lowering.py ${variant//,/ } -- \
        benchmarks/bench_gpu_steps.py /tmp/$m.gguf --ctx "${CTX:-4352}" --position "${POSITION:-100}" --runs 50 --profile \
        2>&1 | tail -4
    done
  done 2>&1 | tee "$out/ab_pdl_off.txt"
  exit 0
fi
if [ "$stage" = fast ]; then  # the fast prefill kernel by kernel, a process a variant
  # (fourteenth session, H100: fast attention's G = 2, S = 1 (as before), S = 2, 4 and G = 1,
  # S = 4 (shipped), the weights a sub-block a thread (shipped), every product on float16;
  # the GLU four columns a thread (shipped))
  fvariants=${VARIANTS:-"- GLU_UNSCALE_X4=0 FAST_ATTENTION_SPLIT=3"}
  for round in $(seq "${ROUNDS:-2}"); do
    for m in $models; do
      for variant in $fvariants; do
        echo "== round $round $m $variant"
        [ "$variant" = - ] && variant=
        timeout 90 python3 benchmarks/with_lowering.py ${variant//,/ } -- \
          benchmarks/bench_gpu_steps.py /tmp/$m.gguf --numerics "${NUMERICS:-fast}" --ctx 4352 \
          --prefill "${PREFILL_N:-512}" --runs 20 --profile > /tmp/fast_run.txt 2>&1
        python3 - /tmp/fast_run.txt <<'PY'
import json, sys
for line in open(sys.argv[1]):
    what, _, rest = line.partition(" ")
    if what.startswith("prefill") and what.endswith("_ms_events"):
        print(what, rest.strip())
    elif what.startswith("prefill") and rest.startswith("{"):
        t = json.loads(rest)
        print("busy_us", t["busy_us"], "|", "; ".join(
            f"{k.split('(')[0]} {us} x{n}" for k, (us, n) in list(t["kernels_us_count"].items())[:10]))
    elif "Error" in line or "error" in line:
        print(line.rstrip())
PY
      done
    done
  done 2>&1 | tee "$out/fast.txt"
  exit 0
fi
if [ "$stage" = deep ]; then  # where depth and long prompts go: kernel by kernel, PDL off too
  for m in $models; do
    ctx=16640; pos=16000; [ "$m" = smollm2-135m ] && { ctx=8192; pos=8000; }
    for pdl in 1 0; do
      for p in 4000 $pos; do
        echo "== $m decode at $p, prefill 4096, PDL $pdl"
        PARITY_PDL=$pdl timeout 120 python3 benchmarks/bench_gpu_steps.py /tmp/$m.gguf \
          --ctx $ctx --position $p --prefill 4096 --runs 50 --profile 2>&1 | tail -4
      done
    done
  done 2>&1 | tee "$out/deep.txt"
  exit 0
fi
if [ "$stage" = half ]; then  # triton:fast's products on float16 tensor cores
  echo "== parity conformance triton --numerics fast, PARITY_TRITON_HALF_GEMM=1"
  PARITY_TRITON_HALF_GEMM=1 timeout 200 python3 -m parity conformance triton --numerics fast \
    2>&1 | tee "$out/conformance_half.txt" | tail -3
  for round in 1 2; do
    for m in $models; do
      for half in 0 1; do
        echo "== round $round $m PARITY_TRITON_HALF_GEMM=$half"
        PARITY_TRITON_HALF_GEMM=$half timeout 120 python3 benchmarks/bench_gpu_steps.py \
          /tmp/$m.gguf --backend triton --numerics fast --ctx 4352 --prefill 512 --runs 20 \
          --profile 2>&1 | tail -6
      done
    done
  done 2>&1 | tee "$out/half.txt"
  exit 0
fi
if [ "$stage" = ncu ]; then  # counters of the first launches of each kernel named
  m=${NCU_MODEL:-qwen2.5-coder-0.5b}
  sections="SpeedOfLight Occupancy LaunchStats WarpStateStats SchedulerStats ComputeWorkloadAnalysis MemoryWorkloadAnalysis SourceCounters"
  for k in ${NCU_KERNELS:-gemm_mma rms_norm_f32 attention_chunks gemv_q}; do
    echo "== ncu $m $k"
    timeout "${NCU_S:-150}" ncu --clock-control none --kernel-name-base demangled -k "regex:$k" \
      -c "${NCU_COUNT:-4}" \
      $(printf -- "--section %s " $sections) python3 -m parity bench --model /tmp/$m.gguf \
      --backend cuda -p 512 -g 8 2>&1
  done > "$out/ncu.txt" 2>&1
  grep -E "^== |^  [a-z].*\(|Duration|Registers Per|Achieved Occupancy|Issue Slots Busy|No Eligible|==ERR" \
    "$out/ncu.txt" | head -120
  exit 0
fi
if [ "$stage" = table ]; then
  args=(--runners "${RUNNERS:-cuda:exact,triton:fast}" --depths "${DEPTHS:-0,4096,16384}"
        --prefill "${PREFILL:-128,4096,512}" --repeat 3 --json "$out/table.json")
  lb=$(ls /tmp/lcpp/build/bin/llama-bench 2>/dev/null) && args+=(--llama-bench "$lb")
  paths=(); for m in $models; do paths+=("/tmp/$m.gguf"); done
  timeout "${TABLE_S:-560}" python3 benchmarks/bench_gpu.py "${paths[@]}" "${args[@]}" 2>&1 | tee "$out/table.txt"
  exit 0
fi
if [ "$stage" = check ]; then
  (bash .peer/llamacpp-cuda.sh build > /tmp/lcpp_build.txt 2>&1; echo "build rc $?" >> /tmp/lcpp_build.txt) &
  build=$!
  echo "== parity conformance cuda"
  timeout 200 python3 -m parity conformance cuda 2>&1 | tee "$out/conformance.txt" | tail -3
  if [ "${TESTS:-0}" = 1 ]; then
    echo "== kernel tests"
    timeout 200 python3 -m pytest -q --tb=short -p no:cacheprovider tests/test_backend_ops.py \
      --backend cuda 2>&1 | tee "$out/ops_tests.txt" | tail -3
    echo "== gpu tests"
    timeout 240 python3 -m pytest -q --tb=short -p no:cacheprovider tests/test_cuda_backend.py \
      2>&1 | tee "$out/gpu_tests.txt" | tail -3
  fi
  [ "${COMPARE:-1}" = 0 ] || bash "$0" compare
  wait $build; tail -3 /tmp/lcpp_build.txt
  # PACK=1: the build back in pieces small enough to return, for .peer on later calls
  [ "${PACK:-0}" = 1 ] && tar cf - -C /tmp/lcpp/build bin | xz -T0 -6 \
    | split -b 15M - "$out/lcpp-bin.tar.xz." && ls -la "$out"/lcpp-bin.*
  exit 0
fi
if [ "$stage" = verify ]; then  # correctness only, so the processes may share the GPU
  run() {  # NAME COMMAND...: its output and exit status in $out/NAME.txt
    local name=$1; shift
    { timeout "${VERIFY_S:-500}" "$@"; echo "rc $?"; } > "$out/$name.txt" 2>&1
  }
  run conformance_cuda python3 -m parity conformance cuda &
  run ops_tests python3 -m pytest -q --tb=short -p no:cacheprovider tests/test_backend_ops.py \
    --backend cuda &
  run gpu_tests python3 -m pytest -q --tb=short -p no:cacheprovider tests/test_cuda_backend.py &
  run conformance_mma64 python3 benchmarks/with_lowering.py MMA_TOKENS=64 MMA_QUANTIZE=1 -- \
    -m parity conformance cuda -k matmul -k fusion &  # (gemm_mma's blocks of 64 tokens)
  run conformance_prefill python3 benchmarks/with_lowering.py MMA_QUANTIZE=1 MMA_GLU=1 MMA_MULTI=1 \
    NORM_WARP_WIDTH_MAX=2048 -- -m parity conformance cuda -k fusion -k norm &  # (ninth session)
  # (fast attention, on under numerics = fast since the eleventh session, one group of warps
  # and four blocks a (head, 64 tokens) since the fourteenth: conformance_cuda; two groups and
  # three blocks, and one block, the kernel's other forms, here)
  run conformance_fast_attention2 python3 benchmarks/with_lowering.py FAST_ATTENTION_GROUPS=2 \
    FAST_ATTENTION_SPLIT=3 -- -m parity conformance cuda --numerics fast -k attention &
  run conformance_fast_attention1 python3 benchmarks/with_lowering.py FAST_ATTENTION_SPLIT=1 \
    -- -m parity conformance cuda --numerics fast -k attention &
  # (fast attention for heads of 256, on since the fifteenth session: conformance_cuda and
  # gpu_tests, as shipped; off, the exact kernels, which conformance_cuda's exact run takes)
  # (twelfth session: fast products on the TF32 tensor cores; thirteenth: on float16 operands,
  # shipped for weights of 1M elements or more: here both forms on every product)
  run conformance_fast_gemm python3 benchmarks/with_lowering.py FAST_GEMM=1 FAST_GEMM_HALF=0 \
    FAST_GEMM_MIN_ELEMENTS=0 -- -m parity conformance cuda --numerics fast &
  run conformance_fast_gemm_half python3 benchmarks/with_lowering.py FAST_GEMM=1 \
    FAST_GEMM_MIN_ELEMENTS=0 FAST_GEMM_HALF=1 -- -m parity conformance cuda --numerics fast &
  # (fourteenth session: the float16 products' GLU four columns a thread, on; one, here)
  run conformance_fast_glu1 python3 benchmarks/with_lowering.py FAST_GEMM=1 \
    FAST_GEMM_MIN_ELEMENTS=0 GLU_UNSCALE_X4=0 -- -m parity conformance cuda --numerics fast \
    -k fusion -k matmul_swiglu &
  # (sixteenth session: a decode norm made by the products that read it, off)
  run conformance_norm_in python3 benchmarks/with_lowering.py NORM_IN_PRODUCT=1 -- -m parity \
    conformance cuda -k fusion -k norm &
  # (seventeenth session: decode loads before PDL's wait, EARLY_LOADS, on; the kernels without
  # them, which run where PDL is off, here; a race of the early loads with the kernel before
  # would show in the twins' decode steps: `SHORT=1 bash benchmarks/gpu_bench.sh compare`)
  run conformance_early python3 benchmarks/with_lowering.py EARLY_LOADS=0 -- -m parity \
    conformance cuda &
  # (eighteenth session: a decode step's norms a slot a thread, NORM_SLOTS, on; rms_norm_f32's
  # decode rows, which rows wider than 1,024 still take, here)
  run conformance_norm_block python3 benchmarks/with_lowering.py NORM_SLOTS=0 -- -m parity \
    conformance cuda -k fusion -k norm &
  # (nineteenth session: a one-token gate/up a block a 32-row group, GROUP_Q8, with Gemma 3's
  # GEGLU in the product)
  run conformance_group python3 benchmarks/with_lowering.py GROUP_Q8=1 GLU_IN_PRODUCT=1 -- -m \
    parity conformance cuda -k fusion -k matmul_swiglu &
  # (twentieth session: heads of 256 scored a K slab ahead, their sums a block a quarter of a
  # chunk; off until timed)
  run conformance_slabs_ahead python3 benchmarks/with_lowering.py CHUNKS_SLABS_AHEAD=1 \
    QUARTER_SUMS=1 -- -m parity conformance cuda -k attention &
  # (twenty-first session: QUARTER_SUMS on; attention_sums<256>, which heads of 256 took before,
  # here)
  run conformance_sums256 python3 benchmarks/with_lowering.py QUARTER_SUMS=0 -- -m parity \
    conformance cuda -k attention &
  # (twenty-fourth session: a group a cluster of 2 or 4 blocks, GROUP_Q8_SPLIT, Gemma 3's GEGLU in
  # the product too; clusters of 4 at 2 rows a warp, 4 warps a block, the form Qwen's gate/up
  # takes, which the kit's 32 groups would not pick)
  run conformance_split2 python3 benchmarks/with_lowering.py GROUP_Q8_SPLIT=2 GLU_IN_PRODUCT=1 \
    -- -m parity conformance cuda -k fusion -k matmul_swiglu &
  run conformance_split4 python3 benchmarks/with_lowering.py GROUP_Q8_SPLIT=4 GROUP_Q8_RPW=2 \
    GLU_IN_PRODUCT=1 -- -m parity conformance cuda -k fusion -k matmul_swiglu &
  files=(conformance_cuda ops_tests gpu_tests conformance_mma64 conformance_prefill
         conformance_fast_attention1 conformance_fast_attention2 conformance_fast_gemm
         conformance_fast_gemm_half conformance_fast_glu1 conformance_norm_in conformance_early
         conformance_norm_block conformance_group conformance_slabs_ahead conformance_sums256
         conformance_split2 conformance_split4)
  # (VERIFY_SKIP="triton deep": not the triton backend's, nor the deep switches' attention)
  if [[ " ${VERIFY_SKIP:-} " != *" triton "* ]]; then
    files+=(conformance_triton)
    { timeout "${VERIFY_S:-500}" python3 -m parity conformance triton; echo "rc $?"  # exact, fast
      PARITY_TRITON_HALF_GEMM=1 timeout "${VERIFY_S:-500}" python3 -m parity conformance triton \
        --numerics fast; echo "rc $?"
    } > "$out/conformance_triton.txt" 2>&1 &
  fi
  if [[ " ${VERIFY_SKIP:-} " != *" deep "* ]]; then
    files+=(conformance_deep)
    fold=FOLD_BATCH=8; caps=CHUNKS_MIN_BLOCKS=2,SUMS_MIN_BLOCKS=2
    all3="HEADS_TOGETHER_CHUNKS[64]=3,HEADS_TOGETHER_CHUNKS[128]=3,HEADS_TOGETHER_CHUNKS[256]=1"
    from16="HEADS_TOGETHER_CHUNKS[64]=16,HEADS_TOGETHER_CHUNKS[256]=16"
    for variant in TILE_SCORES_BYTES=0 $fold,$caps "$all3" "$fold,$caps,$from16"; do
      echo "== parity conformance cuda -k attention with $variant"
      timeout "${VERIFY_S:-500}" python3 benchmarks/with_lowering.py ${variant//,/ } -- -m \
        parity conformance cuda -k attention > /tmp/conformance_variant.txt 2>&1
      echo "rc $?"; tail -2 /tmp/conformance_variant.txt
    done > "$out/conformance_deep.txt" 2>&1 &
  fi
  wait
  for f in "${files[@]}"; do
    echo "== $f"; grep -E "passed|failed|bit-exact|error|Error|rc [0-9]|==" "$out/$f.txt" | tail -8
  done
  paths=("${files[@]/#/$out/}"); paths=("${paths[@]/%/.txt}")  # (a check that failed: exit 1)
  ! grep -qE "^rc [1-9]| [1-9][0-9]* FAIL" "${paths[@]}"
  exit
fi
if [ "$stage" = compare ]; then
  # (SHORT=1: the models in parallel, prompts of 1 and 600 tokens, 16 steps and 64 greedy
  # tokens each, about 200 s: decode steps under PDL, flash decoding in one launch and two,
  # against the cpu oracle; SWITCHES: lowering switches, as `with_lowering.py` takes them)
  if [ "${SHORT:-0}" = 1 ]; then
    for m in $models; do
      { timeout "${COMPARE_S:-300}" python3 benchmarks/with_lowering.py ${SWITCHES:-} -- \
          benchmarks/gpu_compare.py /tmp/$m.gguf --prompts 1,600 --steps 16 --greedy 64
        echo "rc $?"; } > "$out/compare_$m.txt" 2>&1 &
    done
    wait
    for m in $models; do echo "== compare cpu,cuda $m"; grep -v "^lowering" "$out/compare_$m.txt"; done
    exit 0
  fi
  for m in $models; do
    echo "== compare cpu,cuda $m"
    timeout "${COMPARE_S:-300}" python3 benchmarks/gpu_compare.py /tmp/$m.gguf 2>&1 | tee -a "$out/compare.txt"
  done
  exit 0
fi
for m in $models; do
  echo "== parity $m"
  for p in 512 1; do
    timeout 100 python3 -m parity bench --model /tmp/$m.gguf --backend cuda -p $p -g 128 --json 2>&1 | tail -1
  done
  timeout 100 python3 benchmarks/bench_gpu_steps.py /tmp/$m.gguf --runs 200 --position 600 --profile 2>&1 | tail -3
  for freeze in "" ${GC_FREEZE---gc-freeze}; do  # GC_FREEZE= skips the gc.freeze() probe
    timeout 60 python3 benchmarks/bench_gpu_steps.py /tmp/$m.gguf --first-step $freeze \
      > "$out/first_step_$m$freeze.txt" 2>&1
    head -3 "$out/first_step_$m$freeze.txt"
  done
  [ "${LLAMA:-1}" = 0 ] && continue
  echo "== llama.cpp $m (n_prompt n_gen n_depth tok/s stddev)"
  timeout 120 bash .peer/llamacpp-cuda.sh bench /tmp/$m.gguf -d 0,512 2>/dev/null \
    | python3 -c "import json,sys; [print(r['n_prompt'], r['n_gen'], r.get('n_depth', 0), round(r['avg_ts'],1), round(r['stddev_ts'],1)) for r in json.load(sys.stdin)]"
done 2>&1 | tee "$out/bench.txt"
