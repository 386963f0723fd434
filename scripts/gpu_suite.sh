#!/usr/bin/env bash
# Everything the GPU machine checks and measures, in one call (see ../README.md, "On a GPU").
# Runs from the repository root with PYTHONPATH=. and no install; writes evidence under $OUT.
#   bash scripts/gpu_suite.sh                 # every section
#   bash scripts/gpu_suite.sh parity compare  # only the named sections
# The random:* models need only the embedded model's tokenizer files: carry them in .gpucache/
# (made by scripts/prepare_gpu_cache.sh) and point LLM_STEPS_CACHE there.
# step08 needs fastapi, uvicorn and openai, which the GPU machine lacks: carry their wheels in .whl/ and
# install them with --target into a folder on PYTHONPATH before calling this script.
# The tree arrives without .git: pass LLM_STEPS_GIT_COMMIT=<sha> LLM_STEPS_GIT_DIRTY=0|1 so evidence names it.
set -euo pipefail
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 NO_PROXY=127.0.0.1,localhost LLM_STEPS_CACHE="${LLM_STEPS_CACHE:-.gpucache}"
OUT="${OUT:-runs/gpu}"  # ignored by git: copy what a lesson cites into results/
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"

parity() {
  echo "== greedy parity with HF generate() on CUDA, tiny models, fp32, requests arriving while others decode"
  {
    for step in step01_serial step02_paged_kv step03_vectorized_gather; do
      python "$step/run.py" --dry-run --device cuda
    done
    for attn in torch triton; do
      python step06_paged_attention/run.py --dry-run --device cuda --attn "$attn"
    done
    python step12_cuda_graph/run.py --dry-run --device cuda --attn triton
    python step13_fused_decode/run.py --dry-run --device cuda --attn triton
    # The embedded model's weights are not carried to the GPU machine: its tests run on CPU in CI.
    python -m pytest -q -m "not embedded" tests/test_step06_triton_kernels.py tests/test_step06_paged_attention.py \
      tests/test_step12_cuda_graph.py tests/test_step13_engine.py tests/test_step13_fused_kernels.py \
      tests/test_step13_skinny_matmul.py tests/test_step13_packed_projections.py
  } 2>&1 | grep --line-buffered -v "Loading weights" | tee "$OUT/dry-run-cuda.txt"
}

step01_bench() {
  echo "== step01 vs HF generate(): random:qwen2.5-7b, bf16, 32-token prompts, 128 new tokens"
  python step01_serial/run.py --bench --model random:qwen2.5-7b --device cuda --dtype bfloat16 \
    --batch-sizes 1,8 --max-tokens 128 --repeats 5 --bench-output "$OUT/step01-bench-cuda-random-qwen2.5-7b.json"
}

compare() {
  echo "== every step and HF generate() on one workload: random:qwen2.5-7b, bf16, 32-token prompts, 128 new tokens"
  # step01 is serial and step02 loops in Python: past these batches they only take minutes to say the same.
  python compare.py --device cuda --model random:qwen2.5-7b --batch-sizes 1,8,32,64 --max-tokens 128 \
    --max-batch step01_serial=8 --max-batch step02_paged_kv=8 --hf-static-max-batch 8 \
    --repeats 2 --output "$OUT/compare-cuda-random-qwen2.5-7b.json"
}

compare_large_batches() {
  echo "== the paged steps and HF generate() at batch 32 and 64 (the same workload as compare, without the slow steps)"
  python compare.py --device cuda --model random:qwen2.5-7b --batch-sizes 32,64 --max-tokens 128 --repeats 2 \
    --steps step03_vectorized_gather,step06_paged_attention,step07_preemption,step12_cuda_graph \
    --output "$OUT/compare-cuda-random-qwen2.5-7b-batch32-64.json"
}

compare_long() {
  echo "== steps 03, 06 and HF generate() with 1024-token prompts: gathering K/V grows with the context"
  python compare.py --device cuda --model random:qwen2.5-7b --batch-sizes 1,8,32,64 --prompt-len 1024 \
    --max-tokens 128 --steps step03_vectorized_gather,step06_paged_attention \
    --output "$OUT/compare-cuda-random-qwen2.5-7b-prompt1024.json"
}

prefill_vs_paged() {
  echo "== step06's two changes apart: step03, step06 with paged attention only (one prefill per prompt), step06 whole"
  python step06_paged_attention/bench_prefill.py --device cuda --model random:qwen2.5-7b --attn triton \
    --batch-sizes 1,8,32,64 --prompt-lens 32,1024 --max-tokens 128 --output "$OUT/prefill-vs-paged-cuda-random-qwen2.5-7b.json"
}

graphs_large() {
  echo "== step12 on the 256-sequence workload (lengths uniform in [100, 1024]) on random:qwen3-0.6b"
  python step12_cuda_graph/run.py --bench --workload nanovllm --model random:qwen3-0.6b --device cuda --no-hf \
    --bench-output "$OUT/step12-nanovllm-cuda-random-qwen3-0.6b.json"
}

profile_step() {
  echo "== step13: where a replayed decode step's GPU time goes, at batch 1, 8 and 64: plain, fused ops on cuBLAS, fused ops on the skinny matmul, and with PDL"
  python step13_fused_decode/profile_step.py --model random:qwen2.5-7b --batches 1,8,64 \
    --output "$OUT/profile-cuda-random-qwen2.5-7b.json"
}

step12_ablation() {
  echo "== step12 and step13 end to end with each of their optimisations switched off in turn: random:qwen2.5-7b, bf16, 32-token prompts, 128 new tokens"
  for switches in "--no-overlap" "--overlap"; do
    python step12_cuda_graph/run.py --bench --model random:qwen2.5-7b --device cuda --batch-sizes 1,8,64 \
      --max-tokens 128 --repeats 2 --no-hf $switches --bench-output "$OUT/step12-bench${switches// /}.json"
  done
  for switches in "--fused-ops --no-skinny-matmul --no-pdl --no-overlap" \
                  "--fused-ops --no-skinny-matmul --no-pdl --overlap" "--fused-ops --skinny-matmul --no-pdl --overlap" \
                  "--fused-ops --skinny-matmul --pdl --overlap"; do
    python step13_fused_decode/run.py --bench --model random:qwen2.5-7b --device cuda --batch-sizes 1,8,64 \
      --max-tokens 128 --repeats 2 --no-hf $switches --bench-output "$OUT/step13-bench${switches// /}.json"
  done
}

compare_graphs() {
  echo "== step12 and step13 against step06 and HF generate() (default, and static cache + torch.compile): random:qwen2.5-7b, bf16"
  python compare.py --device cuda --model random:qwen2.5-7b --batch-sizes 1,8,32,64 --max-tokens 128 \
    --steps step06_paged_attention,step12_cuda_graph,step13_fused_decode --hf-static-max-batch 8 --repeats 2 \
    --output "$OUT/compare-cuda-random-qwen2.5-7b-step06-step12.json"
}

sync_ablation() {
  echo "== step06 with and without a .item() in every layer (the host waits for the GPU 28 times a step)"
  for sync in "" --sync-per-layer; do
    python step06_paged_attention/run.py --bench --model random:qwen2.5-7b --device cuda --batch-sizes 1,8,32 \
      --max-tokens 128 --repeats 2 --no-hf $sync --bench-output "$OUT/sync-ablation${sync:+-sync-per-layer}.json"
  done
}

checkpoint_memory() {
  echo "== a 7B checkpoint loads onto the GPU without a second copy"
  python scripts/check_checkpoint_memory.py --folder /tmp/ckpt-qwen2.5-7b \
    --output "$OUT/checkpoint-load-memory-qwen2.5-7b.json"
}

matmul_bench() {
  echo "== step13: the skinny matrix multiply against cuBLAS at Qwen2.5-7B's projection shapes, 1 to 16 rows"
  python step13_fused_decode/matmul_bench.py --config qwen2.5-7b --rows 1,2,4,8,16 \
    --output "$OUT/matmul-bench-cuda-qwen2.5-7b.json"
}

kernel_bench() {
  echo "== step06: the paged decode kernel checked, then timed against the copy bandwidth and dense SDPA"
  python step06_paged_attention/run.py --kernel-bench --batches 1,8,16,32,64 --contexts 128,512,2048,8192 \
    --launch-configs 2x2,4x2,4x4,8x2,8x3,8x4 --output "$OUT/kernel-bench-cuda-qwen2.5-7b-heads.json"
  python step06_paged_attention/run.py --kernel-bench --dtype float32 --batches 1,8,64 --contexts 128,2048 \
    --output "$OUT/kernel-bench-cuda-qwen2.5-7b-heads-fp32.json"
}

preempt() {
  echo "== step07: throughput with a generous and a tight budget in both modes, and swap bandwidth"
  python step07_preemption/bench_preempt.py --model random:qwen2.5-7b --device cuda \
    --output "$OUT/preempt-cuda-random-qwen2.5-7b.json"
}

serve() {
  echo "== step08: concurrency through the openai SDK, and the server against the bare engine"
  python step08_serve/bench_serve.py --model random:qwen2.5-7b --device cuda --concurrency 1,2,4,8,16,32 \
    --max-tokens 128 --output "$OUT/serve-cuda-random-qwen2.5-7b.json"
}

serve_graphs() {
  echo "== step08 serving step12's engine: concurrency through the openai SDK, and the server against the bare engine"
  python step08_serve/bench_serve.py --model random:qwen2.5-7b --device cuda --step step12_cuda_graph \
    --concurrency 1,8,32 --max-tokens 128 --output "$OUT/serve-cuda-random-qwen2.5-7b-step12.json"
}

chunked_parity() {
  echo "== step09 and the steps built on it on CUDA: dry runs with a budget of 5 tokens, and their tests"
  {
    for step in step09_chunked_prefill step12_cuda_graph step13_fused_decode; do
      python "$step/run.py" --dry-run --device cuda --attn triton --max-num-batched-tokens 5
    done
    python -m pytest -q -m "not embedded" tests/test_step09_chunked_prefill.py tests/test_step12_cuda_graph.py tests/test_step13_engine.py
  } 2>&1 | grep --line-buffered -v "Loading weights" | tee "$OUT/chunked-dry-run-cuda.txt"
}

long_prompt() {
  echo "== step13: 32 decoders and one 16,000-token prompt: the default budget, then each budget with eager mixed steps; step07 (no budget) alike"
  python step09_chunked_prefill/bench_long_prompt.py --device cuda --model random:qwen2.5-7b --step step13_fused_decode \
    --scenarios stall --decoders 32 --long-prompt-len 16000 --budgets none,default \
    --output "$OUT/long-prompt-cuda-random-qwen2.5-7b-default.json"
  python step09_chunked_prefill/bench_long_prompt.py --device cuda --model random:qwen2.5-7b --step step13_fused_decode \
    --scenarios stall --decoders 32 --long-prompt-len 16000 --budgets ${BUDGETS:-none,256,512,1024,2048,4096,8192} \
    --no-mixed-graphs --output "$OUT/long-prompt-cuda-random-qwen2.5-7b.json"
  python step09_chunked_prefill/bench_long_prompt.py --device cuda --model random:qwen2.5-7b --step step07_preemption \
    --scenarios stall --decoders 32 --long-prompt-len 16000 --output "$OUT/long-prompt-cuda-random-qwen2.5-7b-step07.json"
}

burst() {
  echo "== 64 prompts of 2,080 tokens added at once to the bare engine: step13 with its default budget, and step07"
  python step09_chunked_prefill/bench_long_prompt.py --device cuda --model random:qwen2.5-7b --step step13_fused_decode \
    --scenarios burst --budgets "${BUDGET:-default}" --burst-requests 64 --burst-prompt-len 2080 \
    --output "$OUT/burst-cuda-random-qwen2.5-7b.json"
  python step09_chunked_prefill/bench_long_prompt.py --device cuda --model random:qwen2.5-7b --step step07_preemption \
    --scenarios burst --burst-requests 64 --burst-prompt-len 2080 --output "$OUT/burst-cuda-random-qwen2.5-7b-step07.json"
}

mixed_graphs() {
  echo "== step12's mixed-step graphs: their tests on CUDA, then the stall sweep and the 256-request workload per budget, with and without them"
  python -m pytest -q -m "not embedded" tests/test_step12_mixed_graphs.py 2>&1 | tee "$OUT/mixed-graphs-pytest-cuda.txt"
  python step09_chunked_prefill/bench_long_prompt.py --device cuda --model random:qwen2.5-7b --step step13_fused_decode \
    --mixed-graphs --scenarios stall --decoders 32 --long-prompt-len 16000 --budgets none,256,512,1024,2048 \
    --output "$OUT/long-prompt-cuda-random-qwen2.5-7b-mixed-graphs.json"
  for run in "2048 --no-mixed-graphs" "2048 --mixed-graphs" "512 --mixed-graphs" "1024 --mixed-graphs" "512 --no-mixed-graphs"; do
    set -- $run
    python step13_fused_decode/run.py --bench --workload nanovllm --model random:qwen3-0.6b --device cuda --no-hf \
      --max-num-batched-tokens "$1" "$2" --bench-output "$OUT/nanovllm-cuda-random-qwen3-0.6b-budget$1${2#-}.json"
  done
  python step13_fused_decode/run.py --bench --workload nanovllm --model random:qwen3-0.6b --device cuda --no-hf \
    --bench-output "$OUT/nanovllm-cuda-random-qwen3-0.6b-default.json"
}

prefill_kernel_bench() {
  echo "== step06: the paged prefill kernel, checked then timed per launch, on chunks over long cached prefixes"
  python step06_paged_attention/prefill_kernel_bench.py --points 256x16384,480x16384,1024x16384,2048x2048 \
    --output "$OUT/prefill-kernel-bench-cuda-qwen2.5-7b.json"
}

prefix_caching() {
  echo "== step10: its tests on CUDA, then 64 requests sharing a 2,048-token prefix and 32 conversations x 4 turns, caching on and off"
  python -m pytest -q -m "not embedded" tests/test_step10_prefix_caching.py 2>&1 | tee "$OUT/prefix-caching-pytest-cuda.txt"
  python step10_prefix_caching/bench_prefix.py --device cuda --model random:qwen2.5-7b --step step13_fused_decode --requests 64 --prefix-len 2048 \
    --suffix-len 32 --conversations 32 --turns 4 --user-len 256 --output "$OUT/prefix-cuda-random-qwen2.5-7b.json"
}

burst_serve() {
  echo "== through the server (its default step on a GPU): 64 chat requests of ~2,000 tokens at once, then 256 of ~4,000"
  python step09_chunked_prefill/bench_burst_serve.py --device cuda --model random:qwen2.5-7b --bursts 64x2000,256x4000 \
    --max-tokens 16 --output "$OUT/burst-serve-cuda-random-qwen2.5-7b.json"
}

overlap() {
  echo "== step14: the final engine against step 13 (no overlap) and step 12, batch 1/8/64; the host's work per step with and without overlap; the 256-request workload; a 16,000-token prompt beside 32 decoders"
  python compare.py --device cuda --model random:qwen2.5-7b --batch-sizes 1,8,64 --max-tokens 128 --repeats 2 --no-hf \
    --steps step12_cuda_graph,step13_fused_decode,step14_overlap_scheduling --output "$OUT/compare-cuda-random-qwen2.5-7b-step12-13-14.json"
  python step14_overlap_scheduling/bench_overlap.py --device cuda --model random:qwen2.5-7b --batches 1,8,64 \
    --output "$OUT/overlap-cuda-random-qwen2.5-7b.json"
  python step14_overlap_scheduling/run.py --bench --workload nanovllm --model random:qwen3-0.6b --device cuda --no-hf \
    --bench-output "$OUT/nanovllm-cuda-random-qwen3-0.6b-step14.json"
  python step09_chunked_prefill/bench_long_prompt.py --device cuda --model random:qwen2.5-7b --step step14_overlap_scheduling \
    --scenarios stall --decoders 32 --long-prompt-len 16000 --budgets none,default \
    --output "$OUT/long-prompt-cuda-random-qwen2.5-7b-step14.json"
}

all_tests() {
  # The whole suite outlasts one 10-minute call on the H200: TESTS="..." and PART=name run one part per call. The
  # part stops itself (SIGINT) before the call's limit, so pytest still reports what ran, the slowest tests and a
  # JUnit file naming every test's outcome.
  local log="$OUT/pytest-cuda${PART:+-$PART}"
  echo "== the test suite on CUDA, as a user with a GPU runs it (the embedded model's weights are not carried): ${TESTS:-tests/}"
  timeout -s INT "${TEST_SECONDS:-540}" python -m pytest -q -rs --durations=15 --junitxml="$log.xml" \
    -m "not embedded" ${TESTS:-tests/} 2>&1 | grep --line-buffered -v "Loading weights" | tee "$log.txt"
}

sections=("$@")
[ ${#sections[@]} -gt 0 ] || sections=(parity kernel_bench step01_bench compare compare_long prefill_vs_paged graphs_large matmul_bench profile_step step12_ablation compare_graphs sync_ablation checkpoint_memory preempt serve serve_graphs chunked_parity long_prompt burst burst_serve mixed_graphs prefill_kernel_bench prefix_caching)
for section in "${sections[@]}"; do "$section"; done
