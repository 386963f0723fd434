"""Replicas: N whole engines, one per device, each stepping on its own, and a router that gives each request to
one of them. Replicas multiply throughput when one device is busy; they make no token faster.

Replica 0 runs in this process (it also lends the router its tokenizer and its checks), the others each in a
process of their own. A step sends every replica its new requests and aborts and lets them all step at once,
then gathers what they emitted.

The router counts in tokens. A replica's load is its outstanding tokens (prompt tokens still to compute plus
tokens still to generate); a request sent there adds its prompt, less the start of it that the replica already
holds in whole KV blocks (what step 10 would find cached there). The request goes where that sum is smallest:
to the least loaded replica, unless another holds enough of its prompt to make up the difference. A chat
template's first block saves a few tokens and moves nothing; a shared 2,000-token document keeps its requests
on the replica that holds it until that one is 2,000 tokens busier than another. The router only knows what it sent: it keeps the
block keys of the prompts it gave each replica, as many as that replica's pool holds, least recently used out.
"""

from __future__ import annotations

import dataclasses
import itertools
import atexit
import signal
from collections import OrderedDict
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.multiprocessing as mp

from common.engine import EngineConfig
from common.request import Completion, FinishReason, RequestOutput
from common.sampling import SamplingParams
from common.steps import find_step
from step04_multi_gpu.tensor_parallel import quiet, watch_parent
from step10_prefix_caching.block_pool import chain_keys


def replica_devices(config: EngineConfig, size: int) -> list[str]:
    """A GPU each (replica i on cuda:i), refusing more replicas than GPUs; on a CPU the replicas share it."""
    if config.resolved_device().type != "cuda":
        return ["cpu"] * size
    if size > torch.cuda.device_count():
        raise ValueError(f"--data-parallel-size {size} needs {size} GPUs; this machine has "
                         f"{torch.cuda.device_count()}")
    return [f"cuda:{replica}" for replica in range(size)]


def serve_replica(connection: Connection, step_name: str, config: EngineConfig) -> None:
    """A replica's process: build its engine, then run what the router sends, answering each batch of commands
    with what the engine emitted and its stats."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the router's to handle: it stops the replicas
    watch_parent()
    quiet()
    engine = find_step(step_name).engine_class().from_config(config)
    connection.send(("ready", engine.allocator.num_blocks))
    while True:
        commands = connection.recv()
        outputs: list[RequestOutput] = []
        error = None
        for kind, *args in commands:
            if kind == "add":
                try:
                    engine.add_request(*args)
                except ValueError as err:  # the router checked it already: a config mismatch, said plainly
                    error = str(err)
            elif kind == "abort":
                engine.abort(args[0])
            elif kind == "step":
                outputs.extend(engine.step())
            elif kind == "stop":
                connection.send(("stopped", None))
                return
        connection.send((outputs, engine.stats(), error))


@dataclasses.dataclass
class Routed:
    """What the router keeps about a request it sent: where, and how many tokens it still has to compute."""

    replica: int
    prompt_left: int  # prompt tokens not yet computed (all of them until the first token comes back)
    to_generate: int
    listener: Any = None  # `add_request`'s, put back on the outputs that come from another process

    @property
    def outstanding(self) -> int:
        return self.prompt_left + self.to_generate


class ReplicatedEngine:
    """N engines of `step_name` behind one engine interface (add_request, step, abort, generate, stats, ...)."""

    def __init__(self, step_name: str, config: EngineConfig, data_parallel_size: int) -> None:
        if data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be at least 1, got {data_parallel_size}")
        devices = replica_devices(config, data_parallel_size)
        spawn = mp.get_context("spawn")
        self.connections: list[Connection] = []
        self.processes = []
        for replica in range(1, data_parallel_size):
            ours, theirs = spawn.Pipe()
            process = spawn.Process(target=serve_replica, daemon=True, name=f"replica-{replica}",
                                    args=(theirs, step_name, dataclasses.replace(config, device=devices[replica])))
            process.start()
            self.connections.append(ours)
            self.processes.append(process)
        self.engine = find_step(step_name).engine_class().from_config(
            dataclasses.replace(config, device=devices[0]))
        pools = [self.engine.allocator.num_blocks] + [self.receive(c)[1] for c in self.connections]
        self.block_size = getattr(config, "block_size", 16)
        self.cached_keys: list[OrderedDict[bytes, None]] = [OrderedDict() for _ in pools]
        self.pool_blocks = pools
        self.routed: dict[str, Routed] = {}
        self.pending: list[list[tuple[Any, ...]]] = [[] for _ in self.connections]
        self.replica_stats: list[dict[str, float]] = [{} for _ in self.connections]
        self.requests_routed = [0] * len(pools)
        self.routed_by_prefix = 0
        self.ids = itertools.count()
        self.closed = False
        atexit.register(self.close)

    # ----- the router ----------------------------------------------------------------------------------------

    def route(self, prompt_ids: list[int]) -> tuple[int, int]:
        """The replica where the request's work and the work ahead of it add up to the fewest tokens, and the
        prompt tokens it will compute there (those it does not hold)."""
        keys = list(chain_keys(prompt_ids, self.block_size, (len(prompt_ids) - 1) // self.block_size))
        held = [next((n for n in range(len(keys), 0, -1) if keys[n - 1] in cached), 0)
                for cached in self.cached_keys]
        load = [0] * len(self.pool_blocks)
        for routed in self.routed.values():
            load[routed.replica] += routed.outstanding
        best = min(range(len(load)), key=lambda r: load[r] + len(prompt_ids) - held[r] * self.block_size)
        self.routed_by_prefix += load[best] > min(load)  # its cached prefix outweighed a lighter replica
        cached = self.cached_keys[best]
        for key in keys:  # the prompt's blocks will be cached there: newest last, oldest dropped first
            cached[key] = None
            cached.move_to_end(key)
        while len(cached) > self.pool_blocks[best]:
            cached.popitem(last=False)
        return best, len(prompt_ids) - held[best] * self.block_size

    # ----- the engine interface -------------------------------------------------------------------------------

    def add_request(self, prompt: Any, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0, listener: Any = None) -> str:
        params = params or SamplingParams()
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self.engine.check_prompt(prompt_ids)  # the same checks on every replica: refused here, in one line
        request_id = request_id if request_id is not None else f"req-{next(self.ids)}"
        if request_id in self.routed:
            raise ValueError(f"request id {request_id!r} is already in use")
        replica, to_compute = self.route(prompt_ids)
        if replica == 0:
            self.engine.add_request(prompt_ids, params, request_id=request_id, priority=priority, listener=listener)
        else:
            self.pending[replica - 1].append(("add", prompt_ids, params, request_id, priority))
        self.routed[request_id] = Routed(replica, to_compute, params.max_tokens, listener)
        self.requests_routed[replica] += 1
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        routed = self.routed.pop(request_id, None)
        if routed is None:
            return None
        if routed.replica == 0:
            return self.engine.abort(request_id)
        self.pending[routed.replica - 1].append(("abort", request_id))
        return RequestOutput(request_id, [], "", True, FinishReason.ABORT, routed.listener)  # as its replica's abort

    def step(self) -> list[RequestOutput]:
        """Every replica steps at once (the others in their processes while replica 0 steps here)."""
        busy = [i for i, connection in enumerate(self.connections)
                if self.pending[i] or any(r.replica == i + 1 for r in self.routed.values())]
        for i in busy:
            self.connections[i].send([*self.pending[i], ("step",)])
            self.pending[i] = []
        outputs = self.engine.step() if self.engine.has_unfinished() else []
        for i in busy:
            emitted, self.replica_stats[i], error = self.receive(self.connections[i])
            if error:
                raise RuntimeError(f"replica {i + 1} refused a request replica 0 accepted: {error}")
            outputs.extend(emitted)
        for out in outputs:
            routed = self.routed.get(out.request_id)
            if routed is not None:
                out.listener = routed.listener
                routed.prompt_left, routed.to_generate = 0, routed.to_generate - len(out.new_token_ids)
                if out.finished:
                    del self.routed[out.request_id]
        return outputs

    def generate(self, prompts: Sequence[Any], params: SamplingParams | Sequence[SamplingParams]) -> list[Completion]:
        """Run prompts to completion, in prompt order: built from the outputs, as most requests live elsewhere."""
        per_prompt = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, per_prompt, strict=True)]
        done = {i: Completion(i, [], [], "", FinishReason.ABORT) for i in ids}
        for completion, prompt in zip(done.values(), prompts, strict=True):
            completion.prompt_token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        while self.has_unfinished():
            for out in self.step():
                completion = done[out.request_id]
                completion.token_ids += out.new_token_ids
                completion.text += out.new_text
                completion.finish_reason = out.finish_reason or completion.finish_reason
        return [done[i] for i in ids]

    def has_unfinished(self) -> bool:
        return bool(self.routed) or any(self.pending)

    @property
    def requests(self) -> dict[str, Any]:
        """Replica 0's requests (the others' live in their processes)."""
        return self.engine.requests

    def stats(self) -> dict[str, float]:
        """Replica 0's stats summed with the others' (as of their last step), and the router's own."""
        total = dict(self.engine.stats())
        for stats in self.replica_stats:
            for name, value in stats.items():
                total[name] = total.get(name, 0) + value
        load = [0] * len(self.pool_blocks)
        for routed in self.routed.values():
            load[routed.replica] += routed.outstanding
        for replica, (tokens, count) in enumerate(zip(load, self.requests_routed, strict=True)):
            total[f"replica{replica}_outstanding_tokens"] = tokens
            total[f"replica{replica}_requests_routed_total"] = count
        total["requests_routed_by_prefix_total"] = self.routed_by_prefix
        return total

    def __getattr__(self, name: str) -> Any:  # tokenizer, max_model_len, check_prompt, ...: replica 0's
        if name == "engine":
            raise AttributeError(name)
        return getattr(self.engine, name)

    # ----- the processes -------------------------------------------------------------------------------------

    def receive(self, connection: Connection) -> Any:
        """The replica's answer; a replica that died is an error that names it, not a wait forever."""
        index = self.connections.index(connection) + 1
        while not connection.poll(1.0):
            process = self.processes[index - 1]
            if not process.is_alive():
                self.close()
                raise RuntimeError(f"replica {index} exited with code {process.exitcode} (its error is above)")
        return connection.recv()

    def close(self) -> None:
        """Stop every replica and wait for it: no process is left behind."""
        if self.closed:
            return
        self.closed = True
        for connection, process in zip(self.connections, self.processes, strict=True):
            if process.is_alive():
                try:
                    connection.send([("stop",)])
                except OSError:
                    pass
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()

    def __enter__(self) -> ReplicatedEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
