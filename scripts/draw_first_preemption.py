"""The worked example of step 07's picture: the first preemption of bench_preempt.py's workload in its tight pool.

Runs step 07's PreemptionEngine (tiny random Llama on the CPU: the scheduler's choices depend on token counts only,
not on the model) on the workload of `step07_preemption/bench/bench_preempt.py` (64 requests, prompts and outputs
of 100 to 512 tokens, blocks of 16) in 593 blocks, and prints the pool at the first preemption: who was running,
how many blocks each held, who needed a block, and the victim.

    .venv/bin/python scripts/draw_first_preemption.py [--preempt swap]
"""

from __future__ import annotations

import argparse

from common.bench import nanovllm_workload
from common.loading import load_model
from common.sampling import SamplingParams
from step07_preemption.engine import PreemptionEngine, PreemptionEngineConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--preempt", choices=("recompute", "swap"), default="recompute")
    p.add_argument("--num-blocks", type=int, default=593)
    args = p.parse_args()
    config = PreemptionEngineConfig(model="tiny-llama", device="cpu", dtype="float32", block_size=16,
                                    num_blocks=args.num_blocks, preempt=args.preempt)
    engine = PreemptionEngine(load_model(config.model, "cpu", config.resolved_dtype()), config)
    workload = nanovllm_workload(64, 100, 512)
    ids = [engine.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
           for prompt, n in zip(workload.prompts, workload.output_lens)]
    number = {request_id: i for i, request_id in enumerate(ids)}
    steps = 0
    first = {}
    original = engine.preempt
    original_reserve = engine.reserve_next_block
    needing = []

    def reserve_next_block(request):  # remember who is asking for a block
        needing[:] = [number[request.request_id]]
        return original_reserve(request)

    def preempt(victim):  # the pool as it stands when the first victim is chosen
        if not first:
            first["running"] = [(number[r.request_id], len(r.block_table), r.num_tokens) for r in engine.running]
            first["victim"] = (number[victim.request_id], len(victim.block_table), victim.num_tokens,
                               len(victim.output_token_ids))
            first["free"] = engine.allocator.num_free
            first["step"] = steps
            first["needing"] = needing[0] if needing else None
        original(victim)

    engine.preempt = preempt
    engine.reserve_next_block = reserve_next_block
    while engine.has_unfinished() and not first:
        engine.step()
        steps += 1
    if not first:
        print(f"pool {args.num_blocks} blocks: nothing was preempted")
        return
    running = first["running"]
    print(f"pool {args.num_blocks} blocks; the first preemption comes in engine step {first['step'] + 1} "
          f"(step 1 prefills the first admissions); free {first['free']}")
    print(f"running {len(running)} requests, {sum(b for _, b, _ in running)} blocks held")
    print("running (request, blocks, tokens):", running)
    print(f"request {first['needing']} needs a new block")
    victim, blocks, tokens, generated = first["victim"]
    print(f"victim: request {victim}, {blocks} blocks, {tokens} tokens ({generated} generated)")
    print(f"after preempt ({args.preempt}): swapped {engine.swapper.stats.swapped_out_blocks} blocks, "
          f"waiting {len(engine.waiting)}, swapped requests {len(engine.swapped)}")


if __name__ == "__main__":
    main()
