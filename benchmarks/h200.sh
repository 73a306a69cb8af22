#!/bin/bash
# One command on the H200: install, GPU tests, benchmarks, a short table last.
# Usage (on the device machine, repository root): bash benchmarks/h200.sh [OUT_DIR]
set -u
OUT=${1:-${OUT:-/tmp/pitstop-out}}
mkdir -p "$OUT"
# the device tool brings back at most 8 files: past that, everything but install.log goes back
# as one bundle (results.tar.gz; `tar xzf` it), whatever case ended the script
bundle() { cd "$OUT" || return; local files; files=$(find . -type f ! -name install.log | wc -l)
  [ "$files" -le 7 ] && return; find . -type f ! -name install.log ! -name results.tar.gz -print0 \
    | tar czf results.tar.gz --null -T - && find . -type f ! -name install.log ! -name results.tar.gz -delete
  echo "== $files result files bundled in results.tar.gz"; }
trap bundle EXIT
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# wheels the device image lacks (gguf, ...) travel in .whl/ (see benchmarks/README.md)
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
# the real SmolLM2 GGUF travels in parts (.gguf/partNN, one a call); joined once all are there
if ls .gguf/part* >/dev/null 2>&1; then
  mkdir -p /tmp/gguf-parts && cp -n .gguf/part* /tmp/gguf-parts/
  if [ "$(ls /tmp/gguf-parts | wc -l)" -ge "${GGUF_PARTS:-4}" ] && [ ! -f /tmp/smollm2.gguf ]; then
    cat /tmp/gguf-parts/part* >/tmp/smollm2.gguf && md5sum /tmp/smollm2.gguf
  fi
fi
# a carried vLLM part (.vv/vpNN) lands in /tmp/vv on every call, whatever BENCHES runs: on
# 2026-12-07 four calls carried parts without running the vllm case, and none of those landed
if ls .vv/vp* >/dev/null 2>&1; then mkdir -p /tmp/vv && cp -n .vv/vp* /tmp/vv/ && echo "== vLLM parts on this machine: $(ls /tmp/vv | tr '\n' ' ')"; fi
python3 -m pip install -q --no-deps --no-build-isolation . >"$OUT/install.log" 2>&1 || { tail -20 "$OUT/install.log"; exit 1; }
cd /tmp && python3 -c "import pitstop, torch; print('pitstop', pitstop.__version__, 'torch', torch.__version__, torch.cuda.get_device_name())" && cd - >/dev/null
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
GPU_TESTS=${GPU_TESTS:-"tests/core/loop/test_overlap.py tests/core/runner/test_gpu_engine.py tests/plugins/kernels/test_fused_gpu.py tests/plugins/samplers/test_sampler.py tests/core/speculation/test_speculative.py"}
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q ${PYTEST_FLAGS--x} -p no:cacheprovider -m gpu $GPU_TESTS 2>&1 | tee "$OUT/gpu-tests.log" | tail -25
  rc=${PIPESTATUS[0]}; [ "$rc" = 124 ] && echo "== GPU tests: cut at TEST_TIMEOUT=${TEST_TIMEOUT:-240} s (no summary above); raise it"
  [ "$rc" != 0 ] && [ "$rc" != 124 ] && echo "== GPU tests: pytest exit $rc"
fi
ABLATION=baseline,+paged,+continuous,+fused,+chunked,+ngram
run() { name=$1; shift; echo "== $name: pitstop bench $*"; timeout ${BENCH_TIMEOUT:-300} pitstop bench "$@" --output "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log" | tail -${TAIL:-30}; }
# issue 28: one row of pitstop beside vLLM (--peer vllm), its log in OUT/NAME.log, the ratio lines shown
vrun() { name=$1; shift; echo "== $name: pitstop bench $* --peer vllm"
  timeout ${VLLM_BENCH_TIMEOUT:-590} pitstop bench "$@" --peer vllm --output "$OUT/$name.json" >"$OUT/$name.log" 2>&1
  echo "   exit $? ($OUT/$name.log)"; grep -E "peer vllm failed|^pitstop\[|^peer:vllm|failed:" "$OUT/$name.log" | cut -c1-400 | tail -6; }
# CHECK_TESTS: groups of test files separated by ';', one pytest process each (-m gpu), started in
# the background by start_groups TAG GGUF and awaited, their summaries printed, by wait_groups TAG
start_groups() { pids=(); g=0; IFS=';' read -ra groups <<<"${CHECK_TESTS:-}"
  for files in "${groups[@]}"; do g=$((g + 1))
    ( SMOLLM_GGUF=$2 timeout ${TEST_TIMEOUT:-500} python3 -m pytest -q -rs -p no:cacheprovider -m gpu --durations=8 \
        $files >"$OUT/gpu-tests-$1-$g.log" 2>&1; echo "pytest exit $?" >>"$OUT/gpu-tests-$1-$g.log" ) &
    pids+=($!)
  done; }
wait_groups() { g=0; for files in "${groups[@]}"; do g=$((g + 1)); wait ${pids[$((g - 1))]}
    echo "== GPU tests ($files):"; grep -E "passed|failed|error|FAILED|ERROR|SKIPPED|pytest exit|^[0-9.]+s " "$OUT/gpu-tests-$1-$g.log" | tail -20; done; }
# NAME: one shard of the GPU correctness matrix (MATRIX_SHARD, default 1/1) beside the CHECK_TESTS
# groups (nothing here is timed; a cut run still leaves the matrix rows so far in
# OUT/matrix-I-of-N.json and the test logs in OUT/gpu-tests-I-of-N-G.log)
matrix_beside_groups() { local gguf=${SMOLLM_GGUF:-/tmp/smollm2.gguf} shard=${MATRIX_SHARD:-1/1}
  local tag=${shard/\//-of-}
  [ -f "$gguf" ] || { echo "== $1: no GGUF at $gguf (set SMOLLM_GGUF, or carry both .gguf parts)"; return; }
  echo "== $1: matrix shard $shard (${PITSTOP_MATRIX_WORKERS:-12} processes) beside pytest -m gpu ${CHECK_TESTS:-}"
  start_groups "$tag" "$gguf"
  SMOLLM_GGUF=$gguf timeout ${MATRIX_TIMEOUT:-540} python3 tests/helpers/gpu_matrix.py --workers ${PITSTOP_MATRIX_WORKERS:-12} \
    --json "$OUT/matrix-$tag.json" --shard $shard 2>"$OUT/matrix-$tag.log" | tail -40
  echo "   matrix exit ${PIPESTATUS[0]}"
  wait_groups "$tag"; }
K=tests/plugins/kernels; W=tests/plugins/weight_formats; F=$K/test_fused_gpu.py
# issue 45's closing checks: every -m gpu file once and the whole correctness matrix, at one commit,
# in four calls on one GPU (the matrix's 207 cases take about 21 minutes of 12 processes, so three
# shards of about 7). verify1 needs no GGUF: the kernels' tests and the engine's that build their
# own models, in four processes (test_fused_gpu.py, about 400 s alone, split in two). verify2..4:
# a third of the matrix each, beside the tests that read the real SmolLM2.
VERIFY1="$F::test_attention_full_size $F::test_long_prefill_and_chunk $F::test_by_batch_decode_tiles_match_the_reference"
VERIFY1="$VERIFY1;$F --deselect $F::test_attention_full_size --deselect $F::test_long_prefill_and_chunk --deselect $F::test_by_batch_decode_tiles_match_the_reference"
VERIFY1="$VERIFY1;$K/test_lora_kernels_gpu.py $K/test_moe_kernels_gpu.py tests/plugins/models/test_moe_models_fused.py $K/test_fused_linear_gpu.py $K/test_fused_linear_lora.py $K/test_fused_layer.py $K/test_prefix_share.py"
VERIFY1="$VERIFY1;tests/core/runner/test_gpu_engine.py tests/core/loop/test_overlap.py tests/plugins/adapters/test_lora.py tests/plugins/adapters/test_lora_fused_layer.py tests/plugins/samplers/test_sampler.py $W/test_weight_formats.py"
VERIFY2="tests/core/speculation/test_speculative.py tests/plugins/samplers/test_logits_processors.py $W/test_gguf_blocks.py $W/test_gguf_gemv.py"
VERIFY3="$W/test_gguf_weights.py tests/core/plugin_system/test_example_strategies.py tests/plugins/executors/test_tensor_parallel.py"
VERIFY4="tests/apps/entrypoints/test_rollout_gpu.py"
# BENCHES=pending: what the 2026-12-05 sessions left unmeasured, in order of what it decides
# (carry the torch_memory_saver and gguf wheels; about 10 minutes: two calls, e.g.
# BENCHES="pending" cut by the first call's limit, then the rest by name): the rollout's exit status
# (issue 49), the host tier after a65a623 on 360 turns (issue 50), the LoRA workspace
# (issue 47: lora_bench and the throughput rows), the MoE routing without memsets (issue 48), and
# (2026-12-05, third session) the fused layer's seven-launch long steps (issue 44: `layer`) and
# cuDNN for long prompts and chunks end to end (issue 44: `prefill44`). Run in this order: the
# rollout's exit may close issue 49, then the principal issue's two rows, then the rest.
if [ -n "${BENCHES+set}" ] && [ "$BENCHES" != "${BENCHES/pending/}" ]; then
  BENCHES=${BENCHES/pending/rollout-exit layer prefill44 multiturn moe48 lora47}
  export MT_N=${MT_N:-360} MT_REPEATS=${MT_REPEATS:-1} MOE_WORKLOADS=${MOE_WORKLOADS:-single}
fi
# BENCHES=layer-default: whether fused.layer can become the default (issues 44, 47, 48): the GPU
# matrix's fused+layer rows (each a fresh process against transformers), nano and single with the
# layer off and on, and nano's LoRA rows with it (medians of 3). About 14 minutes: two calls, the
# second naming the cases the first did not reach (the SmolLM2 GGUF's parts carried for the matrix)
if [ -n "${BENCHES+set}" ] && [ "$BENCHES" != "${BENCHES/layer-default/}" ]; then
  BENCHES=${BENCHES/layer-default/matrix layer-nano layer-single lora-kernels}
  export MATRIX_ONLY=${MATRIX_ONLY:-fused+layer} LAYER_ONLY=${LAYER_ONLY:-layer-off,layer-on}
  export LAYER_REPEATS=${LAYER_REPEATS:-3} LORA_REPEATS=${LORA_REPEATS:-3}
  export LORA_ONLY=${LORA_ONLY:-base,lora-1,lora-8,base-layer,lora-1-layer,lora-8-layer}
fi
# BENCHES=next: what the thirteenth session (2026-12-07) left to measure, most telling first
# (about 11 minutes: two calls): decode attention over ragged contexts (issue 44: is nano's
# decode kernel unbalanced?) and nano with fused.decode_split_tokens, the LoRA GPU tests (with
# the pack at its own launch shapes), nano's LoRA rows with prompt steps packed where N >= K
# (medians of 3), and those prompt steps' GPU busy
if [ -n "${BENCHES+set}" ] && [ "$BENCHES" != "${BENCHES/next/}" ]; then
  BENCHES=${BENCHES/next/decode-ragged decode-split lora-stacked-tests lora-kernels prefill-busy}
  export LORA_ONLY=${LORA_ONLY:-base,lora-1,lora-8} LORA_REPEATS=${LORA_REPEATS:-3}
  export TEST_TIMEOUT=${TEST_TIMEOUT:-150} BUSY_LORA_SHAPES=${BUSY_LORA_SHAPES:-nano-prefill}
  export PREFILL_ROWS=${PREFILL_ROWS:-"base:0 lora8:8 lora8gemms:8:lora.large_steps=gemms lora1:1"}
fi
# BENCHES=layer-lora: LoRA inside the fused layer with the stacked packs in its cuBLAS steps
# (fifteenth session, 8eb2c93; issues 44 and 47): the GPU tests of LoRA in the layer, then
# nano's rows with the layer (the default since the sixteenth session, adapters or not) and
# without it, and single's (about 10 minutes: two calls)
if [ -n "${BENCHES+set}" ] && [ "$BENCHES" != "${BENCHES/layer-lora/}" ]; then
  BENCHES=${BENCHES/layer-lora/lora-layer-tests lora-kernels lora-single}
  export LORA_ONLY=${LORA_ONLY:-base,lora-1,lora-8,lora-1-unfused,lora-8-unfused} LORA_REPEATS=${LORA_REPEATS:-3}
  export LORA_SINGLE_ONLY=${LORA_SINGLE_ONLY:-base,lora-1,lora-1-unfused,lora-1-shrink-before}
fi
# BENCHES=after17: what the seventeenth session (2026-12-07, no GPU drawn) left to measure, most
# telling first (about 12 minutes: two calls, the second naming lora-kernels): the LoRA GPU tests
# with the summed shrink, single's base row (its log's timed choices: do the unsplit shapes of
# 038ce66 win at 1..16 rows?), one adapter, one adapter with lora.shrink_before (its default,
# issue 47's single 0.95x), then nano's rows over one and 8 adapters with the layer on
if [ -n "${BENCHES+set}" ] && [ "$BENCHES" != "${BENCHES/after17/}" ]; then
  BENCHES=${BENCHES/after17/lora-layer-tests lora-single lora-kernels}
  export TEST_TIMEOUT=${TEST_TIMEOUT:-170} LORA_REPEATS=${LORA_REPEATS:-3}
  export LORA_SINGLE_ONLY=${LORA_SINGLE_ONLY:-base,lora-1,lora-1-shrink-before}
  export LORA_ONLY=${LORA_ONLY:-base,lora-1,lora-8}
fi
# BENCHES=after19: what the nineteenth session (2026-12-08, no GPU drawn) built for single, in one call
# (about 9 minutes): the GPU tests of the shared LoRA shrink and of stream-K, then single's base
# and one-adapter rows (the layer times stream-K among the base shapes at 1-16 rows, the shared
# shrink among the LoRA ones: the log's timed choices say which won), then fused_linear_bench on
# llama3-8b at 1 and 16 rows (each projection's split, unsplit and stream-K shapes beside cuBLAS)
if [ -n "${BENCHES+set}" ] && [ "$BENCHES" != "${BENCHES/after19/}" ]; then
  BENCHES=${BENCHES/after19/streamk-tests lora-shared-tests lora-single linear-bench}
  export TEST_TIMEOUT=${TEST_TIMEOUT:-120} LORA_REPEATS=${LORA_REPEATS:-2}
  export LORA_SINGLE_ONLY=${LORA_SINGLE_ONLY:-base,lora-1}
  export LINEAR_BENCH_ARGS=${LINEAR_BENCH_ARGS:---models llama3-8b --rows 1,16 --no-chain --sweep-budget 60}
fi
# BENCHES=after18: what the eighteenth session (2026-12-07, three H100 calls) left to measure on
# one machine before vLLM's rows: the LoRA GPU tests at the final commit, then nano's base, one-
# and 8-adapter rows with the layer on, medians of 3 (issue 47's 0.9x and 0.85x; about 9 minutes)
if [ -n "${BENCHES+set}" ] && [ "$BENCHES" != "${BENCHES/after18/}" ]; then
  BENCHES=${BENCHES/after18/lora-layer-tests lora-kernels}
  export TEST_TIMEOUT=${TEST_TIMEOUT:-170} LORA_REPEATS=${LORA_REPEATS:-3}
  export LORA_ONLY=${LORA_ONLY:-base,lora-1,lora-8}
fi
# layer: the fused decoder layer's four parts (issue 44); its timed choices kept in one place
BENCHES=$(echo " ${BENCHES-nano single} " | sed 's/ layer / layer-tests layer-profile layer-nano layer-single /g')
export PITSTOP_CACHE_DIR=${PITSTOP_CACHE_DIR:-/tmp/pitstop-cache}
for spec in $BENCHES; do
  case $spec in
    nano) run nano offline --workload nano --kernels fused --repeats ${NANO_REPEATS:-1} ;;
    # issue 20: the sampler's logits processors (penalties, bias, min_tokens, logprobs) per call
    api) echo "== sampler processors (benchmarks/sampler_bench.py)"; timeout 300 python3 benchmarks/sampler_bench.py 2>&1 | tail -8 ;;
    # issue 13: the serial loop beside the overlapped one, and the GPU busy fraction
    # issue 22: the old default scheduler beside the new (bounded-step) one
    nano-defaults) run nano-defaults offline --workload nano --kernels fused --matrix benchmarks/workloads/defaults.toml ;;
    single-defaults) run single-defaults offline --workload single --kernels fused --repeats 3 --matrix benchmarks/workloads/defaults.toml ;;
    longtail-defaults) run longtail-defaults online --workload longtail --num-requests ${LT_N:-200} --max-batch-size 64 --kernels fused --matrix benchmarks/workloads/defaults.toml ;;
    nano-overlap) run nano-overlap offline --workload nano --kernels fused --matrix benchmarks/workloads/overlap.toml ;;
    single-overlap) run single-overlap offline --workload single --kernels fused --repeats 3 --matrix benchmarks/workloads/overlap.toml ;;
    longtail-best) for i in 1 2 3; do run longtail-best-$i online --workload longtail --max-batch-size 64 ${LT_FLAGS:-} --matrix ${LT_BEST:-benchmarks/workloads/longtail-best.toml}; done ;;
    # BUSY_SHAPES: shape[:on|off|both] ... (benchmarks/gpu_busy.py)
    longctx) run longctx offline --workload single --model dummy:qwen3-8b --input-len 32000 --output-len 16 --max-model-len 32768 --kernels fused --repeats 2 ;;
    busy) for item in ${BUSY_SHAPES:-nano}; do shape=${item%%:*}; loop=both; [ "$shape" != "$item" ] && loop=${item#*:}
            echo "== GPU busy fraction: $shape ($loop)"; timeout 300 python3 benchmarks/gpu_busy.py --shape $shape --overlap $loop --top ${BUSY_TOP:-0} 2>&1 | grep "^|"; done ;;
    # issue 17: the tensor-parallel path over NCCL with a world of one rank (CUDA graphs with the
    # all-reduce inside, equal to the plain runner); with 2+ GPUs visible also a tp=2 bench (issue 18)
    tp) timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -m gpu tests/plugins/executors/test_tensor_parallel.py 2>&1 | tail -5
        [ "$(nvidia-smi -L | wc -l)" -ge 2 ] && run tp2 offline --workload nano --kernels fused --tensor-parallel-size 2 ;;
    nano-ref) run nano-ref offline --workload nano --kernels reference --num-requests 64 ;;
    single) run single offline --workload single --kernels fused --repeats 3 ;;
    longtail) run longtail online --workload longtail --num-requests ${LT_N:-200} --matrix ${LT_MATRIX:-baseline,+paged,+continuous,+fused,+chunked} --plot "$OUT/longtail.png" ;;
    # issue 9: the ablation (split in two: the reference-kernel columns take most of the time)
    ablation-ref) run ablation-ref online --workload longtail --num-requests ${LT_N:-200} --max-batch-size 64 --matrix $ABLATION --only baseline,+paged,+continuous ;;
    ablation-fused) run ablation-fused online --workload longtail --num-requests ${LT_N:-200} --max-batch-size 64 --matrix $ABLATION --only +fused,+chunked,+ngram ;;
    prefix) run prefix online --workload prefix --num-requests ${LT_N:-200} --max-batch-size 64 --matrix benchmarks/workloads/prefix-ablation.toml ;;
    # issue 44: cascade decode over shared prefix pages (fused.decode_prefix_share): its kernel
    # tests compiled, then the prefix workload with it beside the plain decode
    prefix-share) timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider tests/plugins/kernels/test_prefix_share.py 2>&1 | tail -3
      run prefix-share online --workload prefix --num-requests ${LT_N:-200} --max-batch-size 64 --repeats ${PS_REPEATS:-2} --matrix benchmarks/workloads/prefix-share.toml
      run prefix-share-4k online --workload prefix --shared-prefix-len 4096 --num-requests ${LT_N:-200} --max-batch-size 64 --repeats ${PS_REPEATS:-2} --matrix benchmarks/workloads/prefix-share.toml ;;
    sweeps) run sweeps online --workload longtail --num-requests ${LT_N:-200} --max-batch-size 64 --matrix benchmarks/workloads/longtail-sweeps.toml ${SWEEP_ONLY:+--only $SWEEP_ONLY} ;;
    tuned) run tuned online --workload longtail --max-batch-size 64 --matrix benchmarks/workloads/longtail-tuned.toml ;;
    # issue 16: speculation at batch 1 on the real SmolLM2 (plain, ngram k=4, self-draft k=4 in one
    # matrix run; output tok/s and acceptance), and ngram beside plain on longtail (the adaptation rule)
    spec-single) gguf=${SMOLLM_GGUF:-/tmp/smollm2.gguf}; [ -f "$gguf" ] || { echo "== spec-single: no GGUF at $gguf (set SMOLLM_GGUF)"; continue; }
      sed "s|\"smollm2-135m\"|\"$gguf\"|" benchmarks/workloads/speculative-single.toml >"$OUT/speculative-single.toml"
      run spec-single offline --model "$gguf" --kernels fused --workload benchmarks/workloads/edit-and-chat.jsonl --repeats ${SPEC_REPEATS:-2} --matrix "$OUT/speculative-single.toml" ;;
    spec-longtail) run spec-longtail online --workload longtail --num-requests ${SPEC_LT_N:-160} --max-batch-size 64 --matrix benchmarks/workloads/speculative-longtail.toml ;;
    # issue 19: plugin settings + kinds + commands + logits observer on the GPU (smollm2 GGUF)
    plugins19) M=${SMOLLM_GGUF:-/tmp/smollm2.gguf}
      echo "== pitstop plugins --settings --check --kernels fused"; pitstop plugins --settings --check --kernels fused 2>&1 | tail -45
      echo "== pitstop verify: fused (overlapped loop, CUDA graphs) against reference"
      timeout 300 pitstop verify --model "$M" --kernels fused --max-tokens 32 --json "$OUT/verify-plugins19.json" 2>&1 | tail -20
      run nano-plugins19 offline --workload nano --kernels fused --model "$M" ;;
    # issue 19: the example plugin's scheduler (sjf), kernel set (sdpa) and proposer (recall) on
    # the GPU: its GPU test (sdpa over fused against the reference; greedy tokens equal fused's),
    # then sdpa-over-fused beside fused (with graphs, and eager: sdpa is not graph-safe) on nano,
    # sjf beside chunked on longtail, and recall beside plain and ngram on the real SmolLM2 (batch 1,
    # edit-and-chat; recall also on a second pass). Run with SKIP_TESTS=1 BENCHES=examples19 (the case runs its GPU test).
    examples19) python3 -m pip install -q --no-deps --no-build-isolation ./tests/example_plugin >"$OUT/example-install.log" 2>&1 || { tail -5 "$OUT/example-install.log"; continue; }
      pitstop plugins | grep pitstop-example
      timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -m gpu tests/core/plugin_system/test_example_strategies.py 2>&1 | tail -5
      run nano-fused-64 offline --workload nano --kernels fused --num-requests 64
      run nano-fused-eager-64 offline --workload nano --kernels fused --enforce-eager true --num-requests 64
      run nano-sdpa-64 offline --workload nano --kernels sdpa --sdpa.base fused --num-requests 64
      run longtail-sjf online --workload longtail --num-requests ${LT_N:-100} --max-batch-size 64 --kernels fused --matrix benchmarks/workloads/sjf.toml
      gguf=${SMOLLM_GGUF:-/tmp/smollm2.gguf}; [ -f "$gguf" ] || { echo "== recall-single: no GGUF at $gguf (set SMOLLM_GGUF)"; continue; }
      # one timed pass (recall has seen only the warm-up), then recall alone on a second pass (it has seen the first)
      run recall-first offline --model "$gguf" --kernels fused --workload benchmarks/workloads/edit-and-chat.jsonl --repeats 1 --matrix benchmarks/workloads/recall-single.toml
      run recall-again offline --model "$gguf" --kernels fused --workload benchmarks/workloads/edit-and-chat.jsonl --repeats 2 --matrix benchmarks/workloads/recall-single.toml --only recall ;;
    # issue 19, models as plugins: the real SmolLM2 GGUF converted afresh through the registry (the Llama
    # family's GGUFRules: metadata, tensor names, q/k un-permutation), then fused against reference on it
    models19) M=${SMOLLM_GGUF:-/tmp/smollm2.gguf}
      if [ ! -f "$M" ]; then echo "== models19: no GGUF at $M (set SMOLLM_GGUF)";
      elif ! python3 -c "import gguf" 2>/dev/null; then echo "== models19: the gguf package is missing (its wheel goes in .whl/: benchmarks/README.md)";
      else ( export PITSTOP_CACHE_DIR="$OUT/models19-cache"; rm -rf "$PITSTOP_CACHE_DIR"
        echo "== models19: load $M into a fresh cache, then again from it"
        timeout 300 python3 -c "import sys, time; from pitstop.loading.weights import load_model_source; from pitstop.plugin_system.plugin_manager import get_plugin_manager
print('models19: GGUF claims', get_plugin_manager().gguf_claims())
for _ in range(2):
    t = time.perf_counter(); s = load_model_source(sys.argv[1]); n = sum(1 for _ in s.weights()); mc = s.model_config
    print(f'models19: {mc.architecture} layers={mc.num_layers} hidden={mc.hidden_size} heads={mc.num_heads}/{mc.num_kv_heads} tied={mc.tie_word_embeddings} tensors={n} {time.perf_counter() - t:.1f} s: {s.description}')" "$M" 2>&1 | grep -v " INFO " | tail -6
        echo "== models19: pitstop verify --model $M --kernels fused"
        timeout 300 pitstop verify --model "$M" --kernels fused --max-tokens 32 --json "$OUT/verify-models19.json" 2>&1 | tail -20
        run nano-models19 offline --workload nano --kernels fused --model "$M" ); fi ;;
    # issue 27: every allocator x scheduler x kernels x step budget x overlap (+ preemption, n=2, the
    # issue's table) against transformers fp32 greedy on the real SmolLM2, each configuration in a
    # fresh process with poisoned memory (tests/helpers/gpu_matrix.py); MATRIX_ONLY=TEXT narrows it, and
    # MATRIX_SHARD=1/2 then 2/2 splits it over two calls (the whole of it outlasted 545 s with 16
    # processes on 2026-12-01; with 12 it took 440 s while 39 cases failed early)
    matrix) gguf=${SMOLLM_GGUF:-/tmp/smollm2.gguf}
      if [ ! -f "$gguf" ]; then echo "== matrix: no GGUF at $gguf (set SMOLLM_GGUF)"
      else echo "== matrix: tests/helpers/gpu_matrix.py (${PITSTOP_MATRIX_WORKERS:-12} processes, shard ${MATRIX_SHARD:-1/1})"
        SMOLLM_GGUF=$gguf timeout ${MATRIX_TIMEOUT:-560} python3 tests/helpers/gpu_matrix.py --workers ${PITSTOP_MATRIX_WORKERS:-12} \
          --json "$OUT/matrix.json" --shard ${MATRIX_SHARD:-1/1} ${MATRIX_ONLY:+--only "$MATRIX_ONLY"} 2>"$OUT/matrix.log" | tail -60; fi ;;
    # issue 30: the three rows of the headline table, pitstop alone, as issue 28 measured them
    # (nano median of 3, single median of 5, longtail all 500 requests at 32 clients, median of 3)
    headline) run headline-nano offline --workload nano --kernels fused --repeats 3
      run headline-single offline --workload single --kernels fused --repeats 5
      run headline-longtail online --workload longtail --num-requests 500 --concurrency 32 --max-batch-size 64 --kernels fused --repeats 3 ;;
    # issue 30: correctness only, so both at once: one shard of the matrix (MATRIX_SHARD) beside the
    # GPU test files CHECK_TESTS in a second process (nothing here is timed; a cut run still leaves
    # the matrix rows so far in OUT/matrix-I-of-N.json and the test log in OUT/gpu-tests-I-of-N.log)
    checks) matrix_beside_groups checks ;;
    # issue 45's closing checks, four calls back to back at one commit (the GGUF's part00 carried
    # with verify1, part01 with verify2; the wheels with each): see VERIFY1..4 above
    verify1) CHECK_TESTS=$VERIFY1; echo "== verify1: pytest -m gpu, four processes: $CHECK_TESTS"
      start_groups verify1 "${SMOLLM_GGUF:-/tmp/smollm2.gguf}"; wait_groups verify1 ;;
    verify2|verify3|verify4) n=${spec#verify}; eval "CHECK_TESTS=\$VERIFY$n"; MATRIX_SHARD=$((n - 1))/3
      matrix_beside_groups $spec ;;
    # all four at once on a machine of four or more GPUs: verifyN on GPU N-1, each one's printout in OUT/verifyN.out
    verify-all) gpus=$(nvidia-smi -L | wc -l)
      if [ "$gpus" -lt 4 ]; then echo "== verify-all: $gpus GPU(s); run verify1 .. verify4 (one a call) instead"; continue; fi
      ( export CUDA_VISIBLE_DEVICES=0; CHECK_TESTS=$VERIFY1; start_groups verify1 "${SMOLLM_GGUF:-/tmp/smollm2.gguf}"; wait_groups verify1 ) >"$OUT/verify1.out" 2>&1 &
      for n in 2 3 4; do eval "tests=\$VERIFY$n"
        ( export CUDA_VISIBLE_DEVICES=$((n - 1)); CHECK_TESTS=$tests MATRIX_SHARD=$((n - 1))/3 matrix_beside_groups verify$n ) >"$OUT/verify$n.out" 2>&1 &
      done
      wait; for v in 1 2 3 4; do echo "== verify$v (GPU $((v - 1)))"; cat "$OUT/verify$v.out"; done ;;
    # issue 44: the decoder layer in six ops (fused.layer): the kernels' GPU tests, the skinny-GEMM
    # benchmark against cuBLAS, launches per decode layer from the profiler (graph kernels counted),
    # and nano / single with the layer fused beside unfused (benchmarks/workloads/fused-layer.toml)
    # (layer = layer-tests layer-profile layer-nano layer-single: about 4, 4, 4 and 3 minutes)
    layer-tests) timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -m gpu tests/plugins/kernels/test_fused_linear_gpu.py \
        tests/plugins/kernels/test_fused_layer.py tests/plugins/kernels/test_fused_gpu.py 2>&1 | tee "$OUT/gpu-tests-layer.log" | tail -15
      echo "== fused_linear_bench"; timeout ${LAYER_BENCH_TIMEOUT:-240} python3 benchmarks/fused_linear_bench.py \
        --out "$OUT/fused-linear-bench.json" 2>&1 | tail -${LAYER_BENCH_LINES:-60} ;;
    # 2026-12-06: the GPU tests of what the 2026-12-05 sessions built without a device (the
    # LoRA inside the fused GEMMs, the fused layer, the new tiles), one process, no -x
    new-kernels) timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -m gpu --durations=10 \
        $K/test_fused_linear_gpu.py $K/test_fused_linear_lora.py $K/test_fused_layer.py \
        tests/plugins/adapters/test_lora_fused_layer.py 2>&1 | tee "$OUT/gpu-tests-new-kernels.log" | tail -30 ;;
    # layer-tests' benchmark alone: fused_linear's tiles against cuBLAS, 1-256 rows
    linear-bench) echo "== fused_linear_bench"; timeout ${LAYER_BENCH_TIMEOUT:-240} python3 benchmarks/fused_linear_bench.py \
        ${LINEAR_BENCH_ARGS:-} --out "$OUT/fused-linear-bench.json" 2>&1 | tail -${LAYER_BENCH_LINES:-60} ;;
    # stream-K (fused_linear_stream_k, 2026-12-08) compiled and run on the GPU: its equivalence tests
    streamk-tests) timeout ${TEST_TIMEOUT:-120} python3 -m pytest -q -p no:cacheprovider \
        tests/plugins/kernels/test_fused_linear_stream_k.py 2>&1 | tee "$OUT/gpu-tests-streamk.log" | tail -4 ;;
    # launches per decode layer: 256 rows (cuBLAS or the timed Triton shape) and 16 rows, the decode
    # merge separate or in the last program
    layer-profile) i=0; for opt in "" "--option fused.layer=true" "--option fused.layer=true --option fused.decode_merge=last-program" \
          "--batch 16 --option fused.layer=true --option fused.decode_merge=last-program"; do i=$((i + 1))
        echo "== profile nano-decode ${opt:-(layer unfused)}"
        timeout 300 python3 benchmarks/kernel_profile.py --scenario nano-decode $opt --json "$OUT/profile-layer-$i.json" \
          2>"$OUT/profile-layer-$i.log" | grep -E "launches|^\|" | head -16; done ;;
    layer-nano|layer-single) w=${spec#layer-}
      run $spec offline --workload $w --repeats ${LAYER_REPEATS:-2} --matrix benchmarks/workloads/fused-layer.toml ${LAYER_ONLY:+--only $LAYER_ONLY}
      cp "$PITSTOP_CACHE_DIR/fused_layer.json" "$OUT/" 2>/dev/null && echo "== fused_layer.json: $(grep -c '|' "$OUT/fused_layer.json") choices" ;;
    full500) run full500 online --workload longtail --max-batch-size 64 ${FULL_FLAGS:-} --matrix $ABLATION --only +chunked ;;
    # issue 15: the KV cache in fp8 (e4m3) beside bf16; kv_floor.py: fraction of the bf16 and fp8 floors
    fp8-nano) run fp8-nano offline --workload nano --matrix benchmarks/workloads/kv-fp8.toml; python3 benchmarks/kv_floor.py "$OUT/fp8-nano.json" ;;
    fp8-longtail) echo "== fp8-longtail: longtail, 64 clients, ${LT_N:-200} requests, bf16 vs fp8 KV"
      timeout ${BENCH_TIMEOUT:-420} pitstop bench online --workload longtail --concurrency 64 --max-batch-size 64 --num-requests ${LT_N:-200} \
        --matrix benchmarks/workloads/longtail-fp8.toml --output "$OUT/fp8-longtail.json" >"$OUT/fp8-longtail.log" 2>&1
      grep -E "KV cache:|\[bench\] [a-z0-9_]+: " "$OUT/fp8-longtail.log"; tail -${TAIL:-30} "$OUT/fp8-longtail.log" ;;
    fp8-kernels) echo "== fp8-kernels: decode attention, KV cache bf16 vs fp8 (bytes at the cache's element size)"
      timeout 200 python3 benchmarks/kernels_bench.py --decode-suite bfloat16 --json "$OUT/fp8-kernels-bf16.json" 2>&1 | tail -14
      timeout 300 python3 benchmarks/kernels_bench.py --decode-suite fp8_e4m3 ${FP8_TILES:---decode-tiles 64,4,3 --decode-tiles 128,4,2} --json "$OUT/fp8-kernels-fp8.json" 2>&1 | tail -40 ;;
    # issue 28: vLLM 0.24 beside pitstop, each row one `pitstop bench --peer vllm` (both engines in the
    # same run, vLLM in a process of its own). The wheels travel in .vv/ (benchmarks/vllm_download.sh:
    # vp00..vp06 + vp.sum, one part a run, back to back); benchmarks/vllm_setup.sh joins and installs
    # them under /tmp/vsite once all are there (until then this case says which are missing), with the
    # wheels of .vx/ (added after the parts were made: vllm serve's model-hosting-container-standards,
    # loguru for vLLM's fp8 quantization; benchmarks/vllm_download.sh lists both now).
    # VLLM_ROWS: nano single fp8 single-fp8w nano-fp8w longtail longtail64 longtail128 prefix longctx spec
    # multiturn lora1 lora8 lora8-stacked moe-nano moe-nano-layer moe-single moe-single-layer moe-single-rule (docs/benchmarks.md).
    # issue 29: kernel by kernel, one step of each engine on the same requests (benchmarks/kernel_profile.py);
    # PROFILE_ARGS: more flags for every row (e.g. "--lora-adapters 1", with PEER_OFF=1)
    # PROFILE_ROWS "nano-decode:dummy:qwen3-0.6b single-decode:dummy:llama3-8b prefill-2048:dummy:qwen3-8b"
    profile) PEER=""; [ "${PEER_OFF:-0}" != 1 ] && bash benchmarks/vllm_setup.sh .vv >/dev/null 2>&1 && PEER="--peer vllm" \
        && export PITSTOP_VLLM_PYTHONPATH=${PITSTOP_VLLM_PYTHONPATH:-/tmp/vsite} VLLM_USE_FLASHINFER_SAMPLER=0
      [ -d /tmp/vhttp ] && export PYTHONPATH=/tmp/vhttp${PYTHONPATH:+:$PYTHONPATH}
      for row in ${PROFILE_ROWS:-nano-decode:dummy:qwen3-0.6b single-decode:dummy:llama3-8b prefill-2048:dummy:qwen3-8b}; do
        sc=${row%%:*}; model=${row#*:}; echo "== profile $sc on $model ${PEER:-(no vLLM: pitstop alone)}"
        timeout ${PROFILE_TIMEOUT:-300} python3 benchmarks/kernel_profile.py --scenario $sc --model $model $PEER ${PROFILE_ARGS:-} \
          --trace-dir /tmp/kp-$sc --json "$OUT/profile-$sc.json" >"$OUT/profile-$sc.txt" 2>"$OUT/profile-$sc.log"
        echo "   exit $?"; head -${PROFILE_LINES:-40} "$OUT/profile-$sc.txt"; done ;;
    vllm) if bash benchmarks/vllm_setup.sh .vv; then
        [ -d /tmp/vhttp ] && export PYTHONPATH=/tmp/vhttp${PYTHONPATH:+:$PYTHONPATH}
        export PITSTOP_VLLM_PYTHONPATH=${PITSTOP_VLLM_PYTHONPATH:-/tmp/vsite} VLLM_USE_FLASHINFER_SAMPLER=0
        export PITSTOP_VLLM_START_TIMEOUT=${PITSTOP_VLLM_START_TIMEOUT:-300} PITSTOP_VLLM_TIMEOUT=${PITSTOP_VLLM_TIMEOUT:-420}
        R=${VLLM_REPEATS:-3}
        for row in ${VLLM_ROWS:-nano single}; do
          # the online rows drive vllm serve through pitstop's own client (httpx-sse, carried in .whl/):
          # without it vLLM would start and fail at the first request, minutes of device time for nothing
          case $row in longtail*|prefix|longctx|multiturn) python3 -c "import httpx_sse" 2>/dev/null || {
            echo "== vllm $row: skipped: the online rows need httpx-sse here (carry .whl/ with its wheel)"; continue; } ;; esac
          case $row in
            nano) vrun vllm-nano offline --workload nano --kernels fused --repeats $R ;;
            single) vrun vllm-single offline --workload single --kernels fused --repeats 5 ;;
            fp8) vrun vllm-nano-fp8 offline --workload nano --kernels fused --repeats $R --kv-cache-dtype fp8_e4m3 ;;
            # issue 33: fp8 weights on both sides (vLLM's --quantization fp8)
            single-fp8w) vrun vllm-single-fp8w offline --workload single --kernels fused --weights fp8 --repeats 5 ;;
            nano-fp8w) vrun vllm-nano-fp8w offline --workload nano --kernels fused --weights fp8 --repeats $R ;;
            longtail|longtail64|longtail128) c=${row#longtail}; c=${c:-32}
              vrun vllm-longtail-$c online --workload longtail --num-requests ${LT_N:-500} --concurrency $c \
                --max-batch-size $((c > 64 ? c : 64)) --kernels fused --repeats $R ;;
            prefix) vrun vllm-prefix online --workload prefix --num-requests ${LT_N:-500} --max-batch-size 64 \
                --allocator prefix --kernels fused --repeats $R ;;
            # issue 50: the host tier against vLLM's CPU offloading (the workload gives vLLM its
            # kv_offloading_size and backend); MT_N of the workload's 1,200 turns; MT_MATRIX=+tiered
            # leaves the prefix allocator's column out (1,200 turns take about 4 minutes a column)
            multiturn) vrun vllm-multiturn online --workload multiturn --num-requests ${MT_N:-240} \
                --matrix ${MT_MATRIX:-+prefix,+tiered} --kv-offloading-size 64 --repeats ${MT_REPEATS:-1} ;;
            # issue 47: requests over 8 random rank-16 adapters (lora1: every request the same
            # one) on both sides (vLLM --enable-lora); with `nano` in the same call, each engine's
            # LoRA rows against its own base
            lora8) vrun vllm-lora8 offline --workload nano --kernels fused --lora-adapters 8 --repeats $R ;;
            lora1) vrun vllm-lora1 offline --workload nano --kernels fused --lora-adapters 1 --repeats $R ;;
            # the same with the stacked layout (lora.kernel=stacked, 2026-12-07)
            lora8-stacked) vrun vllm-lora8-stacked offline --workload nano --kernels fused --lora-adapters 8 \
                --option lora.kernel=stacked --repeats $R ;;
            # issue 48: the MoE preset on both sides
            moe-nano) vrun vllm-moe-nano offline --workload nano --model dummy:qwen3-30b-a3b --kernels fused --repeats $R ;;
            moe-nano-layer) vrun vllm-moe-nano-layer offline --workload nano --model dummy:qwen3-30b-a3b --kernels fused \
                --option fused.layer=true --repeats $R ;;
            moe-single) vrun vllm-moe-single offline --workload single --model dummy:qwen3-30b-a3b --kernels fused --repeats 3 ;;
            # the same with fused.layer (a sparse layer's attention half fused, 2026-12-06)
            moe-single-layer) vrun vllm-moe-single-layer offline --workload single --model dummy:qwen3-30b-a3b --kernels fused \
                --option fused.layer=true --repeats 3 ;;
            moe-single-rule) vrun vllm-moe-single-rule offline --workload single --model dummy:qwen3-30b-a3b --kernels fused \
                --option fused.layer=true --option fused.layer_tune=false --repeats 3 ;;
            # one 32,000-token prompt at a time: TTFT (online, so that both sides stream their first token)
            longctx) echo '{"input_len": 32000, "output_len": 16}' >"$OUT/longctx-32k.jsonl"
              vrun vllm-longctx online --workload "$OUT/longctx-32k.jsonl" --model dummy:qwen3-8b --concurrency 1 \
                --max-model-len 32768 --kernels fused --repeats $R ;;
            # n-gram speculation at batch 1 on the real SmolLM2 GGUF, if vLLM loads that file (one
            # sequence at a time on both sides: --max-batch-size 1 is vLLM's max_num_seqs=1)
            spec) gguf=${SMOLLM_GGUF:-/tmp/smollm2.gguf}; [ -f "$gguf" ] || { echo "== vllm spec: no GGUF at $gguf (set SMOLLM_GGUF)"; continue; }
              vrun vllm-spec offline --model "$gguf" --kernels fused --workload benchmarks/workloads/edit-and-chat.jsonl \
                --max-batch-size 1 --max-prefill-batch 1 --speculative ngram --num-speculative-tokens 4 --repeats ${SPEC_REPEATS:-3} \
                --peer-arg 'speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}' ;;
            *) echo "== vllm: unknown row $row (VLLM_ROWS: nano single fp8 single-fp8w nano-fp8w longtail longtail64 longtail128 prefix longctx spec multiturn lora1 lora8 lora8-stacked moe-nano moe-nano-layer moe-single moe-single-layer moe-single-rule)" ;;
          esac
        done
        ls "$OUT"/vllm-*.json >/dev/null 2>&1 && python3 benchmarks/peer_table.py "$OUT"/vllm-*.json
      fi ;;
    # issue 29: the decode sweep (split counts, tiles, fp8 widenings, the one-launch merge) at the
    # default shapes, or SWEEP_SHAPES="256x1024,128x2048,..."; then the two merges end to end
    decode-sweep) echo "== decode sweep (benchmarks/kernels_bench.py --decode-sweep)"
      timeout ${SWEEP_TIMEOUT:-200} python3 benchmarks/kernels_bench.py --decode-sweep --jobs 14 \
        ${SWEEP_SHAPES:+--sweep-shapes $SWEEP_SHAPES} --json "$OUT/decode_sweep.json" >"$OUT/decode_sweep.log" 2>&1
      echo "   exit $?"; sed -n '/^decode sweep/,$p' "$OUT/decode_sweep.log" | head -${SWEEP_LINES:-80} ;;
    # issue 29: decode tiles by batch and cache dtype (fused.decode_tiles) against the fixed ones:
    # their GPU test, then `nano` (median of TILES_REPEATS) with bf16 and fp8 caches
    # issue 29: Qwen3's q/k norm inside rope_and_store beside two rms_norm launches (fused.qk_norm), nano
    # issue 29: where nano's steps lose time: the start-up heap frozen out of the collector (freeze_gc)
    # against not, tiles by batch, bf16 and fp8 caches (the bench log kept for its warnings), each
    # pass's step timeline (benchmarks/step_timeline.py); then one 2k prefill on qwen3-0.6b over bf16
    # and fp8 pages, kernel by kernel (pitstop alone)
    nano-steps) echo "== nano-steps: pitstop bench offline --workload nano --matrix benchmarks/workloads/nano-steps.toml"
      timeout ${BENCH_TIMEOUT:-400} pitstop bench offline --workload nano --repeats ${STEPS_REPEATS:-2} \
        --matrix benchmarks/workloads/nano-steps.toml --output "$OUT/nano-steps.json" >"$OUT/nano-steps.log" 2>&1
      echo "   exit $?"; grep -iE "warn|piecewise|fall(s)? ?back|error" "$OUT/nano-steps.log" | sort | uniq -c | head -12
      tail -${TAIL:-24} "$OUT/nano-steps.log"; python3 benchmarks/step_timeline.py "$OUT/nano-steps.json"
      for kv in bfloat16 fp8_e4m3; do echo "== profile prefill-2048 on dummy:qwen3-0.6b, KV cache $kv (pitstop alone)"
        timeout ${PROFILE_TIMEOUT:-200} python3 benchmarks/kernel_profile.py --scenario prefill-2048 --model dummy:qwen3-0.6b \
          --kv-cache-dtype $kv --json /tmp/profile-prefill-$kv.json >"$OUT/profile-prefill-$kv.txt" 2>/tmp/profile-prefill-$kv.log
        echo "   exit $?"; head -${PROFILE_LINES:-30} "$OUT/profile-prefill-$kv.txt"; done ;;
    # issue 29: fused.fp8_widen = qk-fp8 (q.k on fp8 tensor cores): its GPU test, the decode sweep at
    # nano's shapes (every widening), nano over bf16 / fp8 widened / qk-fp8, verify with it (GGUF)
    fp8-qk) timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -m gpu tests/plugins/kernels/test_fused_gpu.py \
        -k "widened_to_fp16_full_size" 2>&1 | tail -3
      timeout ${SWEEP_TIMEOUT:-150} python3 benchmarks/kernels_bench.py --decode-sweep --jobs 14 \
        --sweep-shapes ${SWEEP_SHAPES:-256x512,64x2048,8x2048} --json /tmp/fp8qk-sweep.json >"$OUT/fp8-qk-sweep.log" 2>&1
      echo "   sweep exit $?"; grep -E "current|best" "$OUT/fp8-qk-sweep.log" | head -${SWEEP_LINES:-30}
      run fp8-qk-nano offline --workload nano --repeats ${QK_REPEATS:-2} --matrix benchmarks/workloads/kv-fp8-qk.toml
      gguf_file=${SMOLLM_GGUF:-/tmp/smollm2.gguf}; [ -f "$gguf_file" ] && python3 -c "import gguf" 2>/dev/null \
        && timeout 300 pitstop verify --model "$gguf_file" --kv-cache-dtype fp8_e4m3 --fused.fp8-widen qk-fp8 \
          --json "$OUT/fp8-qk-verify.json" 2>&1 | grep -v " INFO " | tail -8 ;;
    qk-norm) run qk-norm-nano offline --workload nano --repeats ${QKN_REPEATS:-3} --matrix benchmarks/workloads/qk-norm.toml ;;
    decode-tiles) timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -m gpu tests/plugins/kernels/test_fused_gpu.py \
        -k by_batch 2>&1 | tail -3
      run decode-tiles-nano offline --workload nano --repeats ${TILES_REPEATS:-3} --matrix benchmarks/workloads/decode-tiles.toml ;;
    decode-merge) run decode-merge-single offline --workload single --repeats 3 --matrix benchmarks/workloads/decode-merge.toml
      run decode-merge-nano offline --workload nano --matrix benchmarks/workloads/decode-merge.toml ;;
    # issue 33: the SmolLM2 GGUF kept in its quantized blocks (--weights gguf): its GPU tests, then
    # `single`-shaped decoding on that file beside the dequantized (dense) weights, and verify on it
    gguf-weights) gguf=${SMOLLM_GGUF:-/tmp/smollm2.gguf}; [ -f "$gguf" ] || { echo "== gguf-weights: no GGUF at $gguf (set SMOLLM_GGUF)"; continue; }
      SMOLLM_GGUF=$gguf timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -m gpu tests/plugins/weight_formats/test_gguf_weights.py tests/plugins/weight_formats/test_gguf_gemv.py \
        tests/plugins/weight_formats/test_weight_formats.py 2>&1 | tail -8
      for w in dense gguf; do run gguf-single-$w offline --model "$gguf" --workload single --kernels fused --weights $w --repeats 3; done
      timeout 300 pitstop verify --model "$gguf" --kernels fused --weights gguf --max-tokens 32 --json "$OUT/verify-gguf.json" 2>&1 | grep -v " INFO " | tail -8 ;;
    # issue 33: fp8 weights. Their GPU tests, the GEMMs at llama3-8b's shapes (FP8_SWEEP=1: a
    # grid of skinny tiles too; benchmarks/fp8_gemm_bench.py), then `single` (and FP8W_NANO=1:
    # `nano`) with bf16, fp8 and fp8 without the skinny kernel (benchmarks/workloads/fp8-weights.toml)
    fp8-weights) timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -m gpu tests/plugins/weight_formats/test_fp8_gemm.py \
        tests/plugins/weight_formats/test_weight_formats.py 2>&1 | tail -4
      timeout ${SWEEP_TIMEOUT:-300} python3 benchmarks/fp8_gemm_bench.py ${FP8_SWEEP:+--sweep --best-tiles "$OUT/best-tiles.txt"} --rows ${FP8_ROWS:-1,4,16} \
        --json "$OUT/fp8-gemm.json" 2>"$OUT/fp8-gemm.log"
      # with FP8_SWEEP=1 a fourth configuration: fp8 at the sweep's best tiles (fp8.skinny_tiles)
      m=benchmarks/workloads/fp8-weights.toml
      if [ -s "$OUT/best-tiles.txt" ]; then cp $m "$OUT/fp8-weights.toml"; m="$OUT/fp8-weights.toml"
        printf '\n[fp8-swept]\nkernels = "fused"\nweights = "fp8"\noptions = { "fp8.skinny_tiles" = "%s" }\n' "$(cat "$OUT/best-tiles.txt")" >>$m; fi
      run fp8w-single offline --workload single --repeats ${FP8W_REPEATS:-3} --matrix $m
      [ "${FP8W_NANO:-0}" = 1 ] && run fp8w-nano offline --workload nano --matrix $m ;;
    fp8-verify) gguf_file=${SMOLLM_GGUF:-/tmp/smollm2.gguf}
      if [ ! -f "$gguf_file" ]; then echo "== fp8-verify: no GGUF at $gguf_file (set SMOLLM_GGUF)";
      elif ! python3 -c "import gguf" 2>/dev/null; then echo "== fp8-verify: the gguf package is missing (its wheel goes in .whl/: benchmarks/README.md)";
      else for ref in auto same; do echo "== fp8-verify: pitstop verify --model $gguf_file --kv-cache-dtype fp8_e4m3 --reference-kv-cache-dtype $ref"
        timeout 300 pitstop verify --model "$gguf_file" --kv-cache-dtype fp8_e4m3 --reference-kv-cache-dtype $ref --json "$OUT/fp8-verify-$ref.json" 2>&1 | grep -v " INFO "; done; fi ;;
    # 2026-12-04 (issues 47-50): the features built without a device, first on the GPU. Their GPU
    # tests (LoRA in the whole model with CUDA graphs, fp8 MoE experts, the rollout's sleep/wake/
    # update, tensor parallelism with one NCCL rank), the matrix's MoE and LoRA rows (needs the
    # GGUF and peft from .whl/), the rollout bench on qwen3-8b, and the prefill attention peers
    # (cuDNN, FlashAttention, varlen) over cached pages for issue 44.
    features) gguf=${SMOLLM_GGUF:-/tmp/smollm2.gguf}
      timeout ${TEST_TIMEOUT:-400} python3 -m pytest -q -p no:cacheprovider -m gpu --durations=8 \
        tests/plugins/adapters/test_lora.py tests/plugins/kernels/test_lora_kernels_gpu.py \
        tests/plugins/models/test_moe_models_fused.py tests/plugins/kernels/test_moe_kernels_gpu.py \
        tests/apps/entrypoints/test_rollout_gpu.py ${FEATURE_TESTS:-} 2>&1 | tee "$OUT/gpu-tests-features.log" | tail -15
      [ -f "$gguf" ] && SMOLLM_GGUF=$gguf timeout ${MATRIX_TIMEOUT:-300} python3 tests/helpers/gpu_matrix.py --workers 8 \
        --only "${FEATURE_MATRIX:-qwen3-moe/,smollm2+lora/}" --json "$OUT/matrix-features.json" 2>"$OUT/matrix-features.log" | tail -12
      echo "== rl_bench (dummy:qwen3-8b)"; timeout ${RL_TIMEOUT:-300} python3 benchmarks/rl_bench.py --out "$OUT/rl-qwen3-8b.json" 2>&1 | tail -20
      echo "== prefill attention beside torch's (issue 44)"; timeout 300 python3 benchmarks/kernels_bench.py --suite --peer 2>&1 | grep -i "prefill\|peer" | head -40 ;;
    # 2026-12-05 (issue 44): long prefills through cuDNN (fused.cudnn_prefill): its GPU test, the
    # prefill suite (the engine's cuDNN path beside the Triton kernel and torch's peers), then the
    # 32,000-token prompt on qwen3-8b with cuDNN beside Triton (benchmarks/workloads/cudnn-prefill.toml)
    prefill44) timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -m gpu tests/plugins/kernels/test_fused_gpu.py \
        -k "cudnn or long_prefill or prefill" 2>&1 | tee "$OUT/gpu-tests-prefill44.log" | tail -6
      echo "== prefill suite"; timeout 240 python3 benchmarks/kernels_bench.py --suite --only prefill ${PEER_FLAG---peer} \
        --json "$OUT/prefill-suite.json" >"$OUT/prefill-suite.log" 2>&1; echo "   exit $?"; grep -E "^prefill|peer: torch SDPA CUDNN_ATTENTION gqa|OFF" "$OUT/prefill-suite.log"
      run longctx-cudnn offline --workload single --model dummy:qwen3-8b --input-len 32000 --output-len 16 \
        --max-model-len 32768 --repeats ${LONGCTX_REPEATS:-3} --matrix benchmarks/workloads/cudnn-prefill.toml ;;
    # 2026-12-05, left for the next call: torch_memory_saver's exit (issue 49: both must print
    # "exit 0"; carry its wheel in .whl/ and the GGUF), the cuDNN chunk rule end to end on the
    # 32k prompt (issue 44), and multiturn whole with repeats (issue 50)
    rollout-exit) gguf=${SMOLLM_GGUF:-/tmp/smollm2.gguf}
      python3 -c "import torch_memory_saver" 2>/dev/null || echo "== rollout-exit: torch_memory_saver is not installed (carry its wheel in .whl/)"
      SMOLLM_GGUF=$gguf timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -m gpu tests/apps/entrypoints/test_rollout_gpu.py 2>&1 | tail -3
      echo "   pytest exit ${PIPESTATUS[0]}"
      timeout 200 python3 benchmarks/rl_bench.py --repeats 3 --out "$OUT/rl-tms.json" >"$OUT/rl-tms.log" 2>&1; echo "   rl_bench exit $?"
      grep -E "memory_backend|median_s|freed" "$OUT/rl-tms.log" | head -8 ;;
    # 2026-12-05 (issue 48): split-K in the fused MoE op: its GPU tests, the op's expert-weight
    # bandwidth at batch 1-256 (bf16, fp8), then single and nano on the MoE preset (fresh tile cache)
    moe48) export PITSTOP_CACHE_DIR=${PITSTOP_CACHE_DIR:-/tmp/moe-cache}
      timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -m gpu tests/plugins/kernels/test_moe_kernels_gpu.py \
        tests/plugins/models/test_moe_models_fused.py 2>&1 | tee "$OUT/gpu-tests-moe48.log" | tail -4
      echo "== moe_bench"; timeout 300 python3 benchmarks/moe_bench.py 2>&1 | tee "$OUT/moe-bench.log" | tail -25
      [ "${MOE_FP8:-0}" = 1 ] && { timeout 200 python3 benchmarks/moe_bench.py --fp8 2>&1 | tail -12; }
      for w in ${MOE_WORKLOADS:-single nano}; do run moe-$w offline --workload $w --model dummy:qwen3-30b-a3b --kernels fused --repeats ${MOE_REPEATS:-1}; done ;;
    # issue 48 (2026-12-06): the MoE op's in-launch split sum and one-launch router: its GPU
    # tests, every autotune candidate's time at batch 1-256 (moe_bench --candidates), then the
    # same batches on the tree in .before/src.tgz, installed aside: the baseline in the same call
    # (2026-12-06: `git archive 6b2527a core plugins apps compat pyproject.toml README.md` with
    # this commit's tuning.py and benchmarks/moe_bench.py, so both time alike)
    moe-kernels) export PITSTOP_CACHE_DIR=${PITSTOP_CACHE_DIR:-/tmp/moe-cache}
      timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -m gpu tests/plugins/kernels/test_moe_kernels_gpu.py \
        tests/plugins/models/test_moe_models_fused.py tests/plugins/kernels/test_tuning.py 2>&1 | tee "$OUT/gpu-tests-moe-kernels.log" | tail -4
      timeout 200 python3 -m pytest -q -p no:cacheprovider tests/plugins/kernels/test_moe_router.py 2>&1 | tee -a "$OUT/gpu-tests-moe-kernels.log" | tail -2
      echo "== moe_bench, this commit"; timeout 200 python3 benchmarks/moe_bench.py --batch 1 --candidates --kernels 2>&1 | tee "$OUT/moe-bench-new.log" | tail -60
      timeout 240 python3 benchmarks/moe_bench.py --batch 8 --batch 64 --batch 256 --candidates 2>&1 | tee -a "$OUT/moe-bench-new.log" | grep -v "^fused\|^ *T "
      [ "${MOE_FP8:-0}" = 1 ] && timeout 120 python3 benchmarks/moe_bench.py --fp8 --batch 1 --batch 8 2>&1 | tee -a "$OUT/moe-bench-new.log" | tail -6
      if [ -f .before/src.tgz ]; then rm -rf /tmp/before && mkdir -p /tmp/before && tar xzf .before/src.tgz -C /tmp/before
        python3 -m pip install -q --no-deps --no-build-isolation --target /tmp/before-site /tmp/before >"$OUT/install-before.log" 2>&1
        echo "== moe_bench, .before"; ( cd /tmp && PITSTOP_CACHE_DIR=/tmp/moe-cache-before PYTHONPATH=/tmp/before-site${PYTHONPATH:+:$PYTHONPATH} \
          timeout 120 python3 /tmp/before/benchmarks/moe_bench.py --batch 1 --batch 8 --kernels 2>&1
          timeout 120 python3 /tmp/before/benchmarks/moe_bench.py --batch 64 --batch 256 2>&1 ) | tee "$OUT/moe-bench-before.log" | tail -40
      fi ;;
    # issue 48 (2026-12-06, sixth session): every MoE test on the GPU in a fresh tile cache (a cold
    # cache found the router's counters made inside a capture): the GPU files, then the CPU files
    # compiled (the one-token grouping, the down GEMM's own slot sum, the norm inside the op)
    moe-tests) export PITSTOP_CACHE_DIR=/tmp/moe-tests-cache-$$
      timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -m gpu tests/plugins/kernels/test_moe_kernels_gpu.py \
        tests/plugins/models/test_moe_models_fused.py tests/plugins/kernels/test_tuning.py 2>&1 | tee "$OUT/gpu-tests-moe.log" | tail -4
      # the interpreter-sized property tests compiled on the GPU: about 4 minutes in one process
      [ "${MOE_PROPS:-1}" = 1 ] && timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -n 4 tests/plugins/kernels/test_moe_router.py \
        tests/plugins/kernels/test_moe_kernels.py 2>&1 | tee -a "$OUT/gpu-tests-moe.log" | tail -4 ;;
    # issue 48: the one-launch router off / on / on with the sparse layers' attention half fused
    # (benchmarks/workloads/moe.toml), single on the MoE preset, pitstop alone
    moe-ab) run moe-ab offline --workload single --model dummy:qwen3-30b-a3b --repeats ${MOE_REPEATS:-3} \
        --matrix benchmarks/workloads/moe.toml
      # the timed choice's shapes, to set beside the rule's (docs/benchmarks.md, eighth session)
      cp "${PITSTOP_CACHE_DIR:-$HOME/.cache/pitstop/fused}/fused_layer.json" "$OUT/moe-ab-fused_layer.json" 2>/dev/null \
        && echo "== fused_layer.json: $(grep -c '|' "$OUT/moe-ab-fused_layer.json") choices" ;;
    # issue 48 (2026-12-06, ninth session): nano on the MoE preset with and without fused.layer (its
    # post-attention norm inside the MoE op), pitstop alone: whether the layer pays at 256 rows too
    moe-nano-ab) run moe-nano-ab offline --workload nano --model dummy:qwen3-30b-a3b --repeats ${MOE_REPEATS:-1} \
        --matrix benchmarks/workloads/moe.toml --only router-on,router-on-layer ;;
    # issue 48: the MoE op at MOE_BATCHES (default 1 2 8 64 256): the device's copy rate, the
    # tuned op, the engine's call (router weight, norm, residual), each kernel's time
    moe-bench) export PITSTOP_CACHE_DIR=${PITSTOP_CACHE_DIR:-/tmp/moe-cache}; bs=""
      for b in ${MOE_BATCHES:-1 2 8 64 256}; do bs="$bs --batch $b"; done
      timeout 300 python3 benchmarks/moe_bench.py $bs --kernels 2>&1 | grep -v "warn\|UserWarning" | tee "$OUT/moe-bench.log" | tail -30 ;;
    # issue 48 (2026-12-07, eighteenth session): one token's early down (fused.moe_early_down,
    # off until measured): its GPU tests, the op at batch 1 (early and engine-early rows beside
    # tuned and engine), then single on the MoE preset with it beside the defaults
    moe-early) export PITSTOP_CACHE_DIR=${PITSTOP_CACHE_DIR:-/tmp/moe-cache}
      timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider tests/plugins/kernels/test_moe_kernels_gpu.py \
        -k "early or three_launches" 2>&1 | tee "$OUT/gpu-tests-moe-early.log" | tail -3
      timeout 200 python3 benchmarks/moe_bench.py --batch 1 --kernels 2>&1 | grep -v "warn\|UserWarning" \
        | tee "$OUT/moe-bench-early.log" | tail -14
      run moe-early offline --workload single --model dummy:qwen3-30b-a3b --repeats ${MOE_REPEATS:-3} \
        --matrix benchmarks/workloads/moe.toml --only router-on-layer,router-on-layer-early-down ;;
    # issue 48: a sweep of the MoE op's tiles (MOE_SWEEP: M,N,K,WARPS,STAGES[,SPLIT] specs) at
    # MOE_SWEEP_BATCHES, each kernel's time; fp8 experts at batch 1
    moe-sweep) export PITSTOP_CACHE_DIR=${PITSTOP_CACHE_DIR:-/tmp/moe-cache}
      cfgs=""; for c in ${MOE_SWEEP:-16,64,128,4,4}; do cfgs="$cfgs --config $c"; done
      bs=""; for b in ${MOE_SWEEP_BATCHES:-1 8}; do bs="$bs --batch $b"; done
      echo "== moe sweep"; timeout 240 python3 benchmarks/moe_bench.py $bs $cfgs --kernels 2>&1 | tee "$OUT/moe-sweep.log" | grep -v "warn\|^fused\|^ *T "
      echo "== fp8 experts"; timeout 100 python3 benchmarks/moe_bench.py --fp8 --batch 1 --kernels 2>&1 | tee "$OUT/moe-fp8.log" | grep -v "warn\|^fused\|^ *T " ;;
    # issue 50: the host tier beside the prefix allocator (MT_N turns of the workload's 1,200;
    # 360 take about 200 s for both columns; after a65a623 the tier should hit about 76%)
    multiturn) run multiturn online --workload multiturn ${MT_N:+--num-requests $MT_N} --matrix +prefix,+tiered \
        --kv-offloading-size 64 --repeats ${MT_REPEATS:-3} ;;
    # issue 47: the fused LoRA launch (lora_add, 4 a layer): the LoRA kernel tests compiled (the
    # CPU file runs compiled on CUDA too, Hypothesis included), one layer's launches old beside
    # fused in CUDA graphs (benchmarks/lora_bench.py), then the throughput rows of docs/lora.md
    lora47) timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -x -p no:cacheprovider tests/plugins/kernels/test_lora_kernels_gpu.py \
        tests/plugins/kernels/test_lora_kernels.py 2>&1 | tee "$OUT/gpu-tests-lora47.log" | tail -6
      echo "== lora_bench"; timeout 240 python3 benchmarks/lora_bench.py 2>&1 | tee "$OUT/lora-bench.log"
      run lora-nano offline --workload nano --matrix benchmarks/workloads/lora.toml
      run lora-single offline --workload single --repeats 2 --matrix benchmarks/workloads/lora.toml --only base,lora-1,lora-1-overlap ;;
    # issue 47 (2026-12-05, fifth session): the adapters' deltas inside fused.layer's Triton GEMMs:
    # their GPU tests, lora_bench's "fused.layer GEMM with the LoRA inside", then single (and nano)
    # with fused.layer on both sides (LORA_LAYER_NANO=1 adds nano, about 3 minutes)
    # LORA_PARTS: which of tests, bench (lora_bench's cases), single (the engine rows) to run
    lora-layer) parts=" ${LORA_PARTS:-tests bench single} "
      [[ $parts == *" tests "* ]] && timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -x -p no:cacheprovider -m gpu \
        tests/plugins/kernels/test_fused_linear_lora.py tests/plugins/adapters/test_lora_fused_layer.py 2>&1 | tee "$OUT/gpu-tests-lora-layer.log" | tail -6
      [[ $parts == *" bench "* ]] && { echo "== lora_bench"; timeout 240 python3 benchmarks/lora_bench.py --case single single-16 nano-1 2>&1 | tee "$OUT/lora-bench-layer.log"; }
      [[ $parts == *" single "* ]] && run lora-layer-single offline --workload single --repeats ${LORA_REPEATS:-3} --matrix benchmarks/workloads/lora.toml --only base-layer,lora-1-layer
      [ -n "${LORA_LAYER_NANO:-}" ] && run lora-layer-nano offline --workload nano --matrix benchmarks/workloads/lora.toml --only base-layer,lora-1-layer,lora-8-layer ;;
    # issue 47 (2026-12-06, ninth session): nano with one and 8 adapters, the default shrink and
    # expand beside the one fused launch (lora.kernel=fused), all against the base row, one call
    # issue 44 (2026-12-07, twelfth session): nano's prompt steps from piecewise CUDA graphs up to
    # the step budget beside the default 2048 (PIECEWISE_ONLY: the rows of piecewise.toml)
    # issue 44 (2026-12-07, thirteenth session): nano with decode contexts in pieces of a fixed length
    decode-split) run decode-split-nano offline --workload nano --repeats ${SPLIT_REPEATS:-3} \
        --matrix benchmarks/workloads/decode-split.toml --only ${SPLIT_ONLY:-base,split-256,split-512,split-1024} ;;
    piecewise) run piecewise-nano offline --workload nano --repeats ${PIECEWISE_REPEATS:-3} \
        --matrix benchmarks/workloads/piecewise.toml --only ${PIECEWISE_ONLY:-base,piecewise-8192,lora-8,lora-8-piecewise-8192} ;;
    lora-kernels) run lora-kernels-nano offline --workload nano --repeats ${LORA_REPEATS:-1} --matrix benchmarks/workloads/lora.toml \
        --only ${LORA_ONLY:-base,lora-1,lora-8,lora-1-stacked,lora-8-stacked,lora-1-fused,lora-8-fused} ;;
    # issue 47 (2026-12-07, eleventh session): single (llama3-8b, batch 1) with one adapter, the default
    # and the stacked layout, beside the base row (about 90 s a row)
    lora-single) run lora-single offline --workload single --repeats ${LORA_REPEATS:-2} --matrix benchmarks/workloads/lora.toml \
        --only ${LORA_SINGLE_ONLY:-base,lora-1,lora-1-stacked} ;;
    # issue 47 (2026-12-07): the stacked layout's GPU tests (the pack kernel compiled, the engine
    # against PEFT under CUDA graphs) and the LoRA kernel tests beside them
    # issue 44 (2026-12-07, thirteenth session): decode attention over nano's ragged contexts
    # against the same bytes at one context (is the kernel's work per program unbalanced?)
    decode-ragged) timeout ${TEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider tests/plugins/kernels/test_fused_gpu.py \
        -k split_tokens 2>&1 | tee "$OUT/gpu-tests-split-tokens.log" | tail -3
      timeout ${RAGGED_TIMEOUT:-400} python3 benchmarks/decode_ragged.py --splits ${RAGGED_SPLITS:-1 2 4} --split-tokens ${RAGGED_TOKENS:-256 512 1024} \
        --json "$OUT/decode-ragged.json" 2>&1 | tee "$OUT/decode-ragged.log" | tail -16 ;;
    # (since the sixteenth session the layer is on by default with adapters too, so
    # test_lora.py's GPU tests run it as well)
    lora-layer-tests) timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -m gpu \
        tests/plugins/adapters/test_lora_fused_layer.py tests/plugins/kernels/test_fused_linear_lora.py \
        tests/plugins/adapters/test_lora.py 2>&1 \
        | tee "$OUT/gpu-tests-lora-layer.log" | tail -6 ;;
    lora-shared-tests) timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -m gpu \
        tests/plugins/kernels/test_fused_linear_lora.py -k "shared or real_shapes" 2>&1 \
        | tee "$OUT/gpu-tests-lora-shared.log" | tail -6 ;;
    lora-bench-single) echo "== lora_bench --case single"; timeout 240 python3 benchmarks/lora_bench.py --case single 2>&1 \
        | tee "$OUT/lora-bench-single.log" | grep -E "^ *(qkv|o|gate_up|down|layer):|fused.layer GEMMs" ;;
    lora-stacked-tests) timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -x -p no:cacheprovider tests/plugins/kernels/test_lora_kernels.py \
        tests/plugins/adapters/test_lora.py tests/plugins/adapters/test_lora_launches.py -k "${LORA_TEST_K-pack or stacked or gpu}" 2>&1 | tee "$OUT/gpu-tests-lora-stacked.log" | tail -6 ;;
    # issue 47 (2026-12-06, ninth session): the LoRA shrink's and expand's launch shapes at nano's
    # 256 rows, one and 8 adapters (the default and each of LORA_TILES: BM,BN,BK,SPLIT[,WARPS,STAGES])
    lora-tiles) timeout ${LORA_TILES_TIMEOUT:-200} python3 benchmarks/lora_bench.py --case nano-8 nano-1 --iters 20 --repeats 3 \
        --tiles ${LORA_TILES:-32,64,128,2 32,64,128,4 16,64,128,4 16,128,128,4 64,128,128,4 64,64,128,8} 2>&1 \
        | grep -v Warn | tee "$OUT/lora-tiles.log" | tail -14 ;;
    # issue 47 (2026-12-07): the stacked layout per projection (lora_pack then one GEMM) beside the
    # GEMM alone and the default shrink and expand, at the default pack shape and LORA_PACK_TILES
    # (LORA_PACK_CASES: nano-8-chunk nano-1-chunk, a prompt step's 8,192 rows: pack against gemms)
    lora-pack) timeout ${LORA_TILES_TIMEOUT:-200} python3 benchmarks/lora_bench.py --case ${LORA_PACK_CASES:-nano-8 nano-1 single} --iters 20 --repeats 3 \
        --pack-tiles ${LORA_PACK_TILES:-32,64,128,1 32,64,128,4 16,64,128,4 64,64,128,2,8,3 32,128,128,2,8,3 32,64,256,2,8,2 16,32,128,8} 2>&1 \
        | grep -v Warn | tee "$OUT/lora-pack.log" | tail -16 ;;
    # issue 47 (2026-12-07, eleventh session): nano's prompt phase alone (nano-prefill) and its steady
    # decode (nano), GPU busy and wall per step, base beside LoRA (benchmarks/gpu_busy.py; BUSY_LORA_SHAPES;
    # PREFILL_ROWS: NAME:ADAPTERS[:OPTION,...]; a NAME ending in +host also prints cProfile's
    # HOST_TOP host functions of the same steps: where the host's time goes)
    prefill-busy) for shape in ${BUSY_LORA_SHAPES:-nano-prefill}; do
      for row in ${PREFILL_ROWS:-base:0 lora8:8 lora8s:8:lora.kernel=stacked lora1s:1:lora.kernel=stacked}; do
        name=${row%%:*}; rest=${row#*:}; n=${rest%%:*}; opts=""; [ "$rest" != "$n" ] && opts=${rest#*:}
        flags=""; for o in ${opts//,/ }; do flags="$flags --option $o"; done
        [ "$name" != "${name%+host}" ] && flags="$flags --host-top ${HOST_TOP:-25}"
        echo "== busy $shape $name ($n adapters$flags)"
        timeout ${BUSY_TIMEOUT:-240} python3 benchmarks/gpu_busy.py --shape $shape --overlap on --top ${BUSY_TOP:-12} \
          --lora-adapters $n $flags 2>&1 | tee "$OUT/busy-$shape-${name/+/-}.log" | grep "^|"; done; done ;;
    # issues 47, 48: decode steps alone (kernel_profile --warm-prompts: the prompts cached first) of
    # nano over 8 LoRA adapters and of nano on the MoE preset (WARM_ROWS: NAME:MODEL, lora8 adds the adapters)
    profile-warm) for row in ${WARM_ROWS:-lora8:dummy:qwen3-0.6b moe:dummy:qwen3-30b-a3b}; do name=${row%%:*}; model=${row#*:}
        extra=""; [ "$name" = lora8 ] && extra="--lora-adapters 8"
        [ "$name" = lora8s ] && extra="--lora-adapters 8 --option lora.kernel=stacked"
        [ "$name" = lora8sn ] && extra="--lora-adapters 8 --option lora.kernel=stacked --option lora.pack_split=false"
        timeout ${PROFILE_TIMEOUT:-200} python3 benchmarks/kernel_profile.py --scenario nano-decode --model "$model" --warm-prompts $extra \
          --json "$OUT/profile-warm-$name.json" >"$OUT/profile-warm-$name.txt" 2>"$OUT/profile-warm-$name.log"
        echo "== profile-warm $name on $model: exit $?"; head -${PROFILE_LINES:-32} "$OUT/profile-warm-$name.txt"; done ;;
  esac
done
