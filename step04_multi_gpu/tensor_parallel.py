"""Tensor parallelism across processes: N ranks, each running the same engine on its shard of the model.

How the ranks stay in step. Every rank runs the whole engine: scheduler, KV pool (of its own KV heads) and
sampler. Rank 0 alone takes requests: before each step it broadcasts what it was asked since the last one (new
requests as token ids, with their seeds and arrival times; aborts), then every rank applies that and steps. A
step's schedule is a function of that input only, and every rank samples from the same gathered logits with
the same seeds, so all ranks take the same decisions without sending them to each other; the all-reduces in
the forward keep them in lockstep. The other design, rank 0 schedules and the others run only its forwards,
needs one interface through which every forward passes; our steps have several (decode, mixed, verification,
each eager or replayed), so each rank runs its own copy of the one that the step chose.

Control messages go over gloo, on the host, even when the model's all-reduces go over NCCL: a broadcast of a
few Python objects should not wait for the GPU.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.engine import Engine, EngineConfig
from common.loading import LoadedModel, load_model
from common.request import RequestOutput
from common.sampling import SamplingParams
from common.steps import STEPS, Step, find_step
from step04_multi_gpu.sharding import TensorParallelConfigError, check_divides, shard_model

TIMEOUT = timedelta(seconds=120)  # a collective that waits longer than this is a rank that died


class RankDiedError(RuntimeError):
    """A rank's process exited while the others needed it."""


@dataclasses.dataclass(frozen=True)
class Launch:
    """Where one rank runs: its number, how many there are, and rank 0's rendezvous (None: torchrun's env)."""

    rank: int
    world_size: int
    device_type: str  # "cpu" or "cuda"
    address: str | None = None  # "host:port"
    backend: str = "gloo"  # of the model's collectives: nccl between GPUs, gloo on CPUs (or GPUs shared by ranks)


def free_address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def check_world(world_size: int, device_type: str, backend: str = "nccl") -> None:
    """Refuse, in one line, more ranks than GPUs for NCCL. On a CPU the ranks share the cores (slowly, but they
    run: that is how the tests check three ranks on a two-core machine), and with gloo they may share GPUs."""
    if device_type == "cuda" and backend == "nccl" and world_size > torch.cuda.device_count():
        raise TensorParallelConfigError(f"--tensor-parallel-size {world_size} needs {world_size} GPUs; this "
                                        f"machine has {torch.cuda.device_count()}")


def join_ranks(launch: Launch) -> tuple[torch.device, dist.ProcessGroup]:
    """Join the process group: this rank's device, and the host-side group that carries control messages."""
    backend = launch.backend
    device = torch.device("cpu")
    if launch.device_type == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // launch.world_size))  # the ranks share the cores
    if launch.device_type == "cuda":
        local = int(os.environ.get("LOCAL_RANK", launch.rank)) % torch.cuda.device_count()
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    init = "env://" if launch.address is None else f"tcp://{launch.address}"
    dist.init_process_group(backend, init_method=init, rank=launch.rank, world_size=launch.world_size,
                            timeout=TIMEOUT, device_id=device if backend == "nccl" else None)
    control = dist.new_group(backend="gloo", timeout=TIMEOUT) if backend == "nccl" else dist.group.WORLD
    return device, control


def steps_where(can: Callable[[type[Engine]], bool]) -> str:
    """The names of the steps whose engines `can`, for a refusal to offer (it imports every engine)."""
    return ", ".join(step.name for step in STEPS if can(step.engine_class()))


def check_splits(step: Step, config: EngineConfig, backend: str) -> None:
    """Refuse, in one line and before any process starts, a step's engine that cannot be split as configured:
    what it can is declared on the engine (splits_over_ranks, captures_cuda_graphs, skips_all_reduces)."""
    engine_class = step.engine_class()
    on_a_gpu = config.resolved_device().type == "cuda"
    if not engine_class.splits_over_ranks:
        raise TensorParallelConfigError(
            f"--tensor-parallel-size splits the engines of steps 06 and later, not {step.name}: "
            f"choose one of {steps_where(lambda e: e.splits_over_ranks)}")
    if backend == "gloo" and on_a_gpu and engine_class.captures_cuda_graphs:
        raise TensorParallelConfigError(
            "gloo's collectives cannot be captured in CUDA graphs: with --distributed-backend gloo on a GPU, "
            f"choose --step among {steps_where(lambda e: e.splits_over_ranks and not e.captures_cuda_graphs)}")
    if on_a_gpu and engine_class.skips_all_reduces(config):
        raise TensorParallelConfigError("step 13's fused kernels read the projections around the model's layers "
                                        "and would skip their all-reduces: not split yet; add --no-fused-ops")


def sharded_engine_class(engine_class: type[Engine], control: dist.ProcessGroup) -> type[Engine]:
    """The step's engine with one change: its KV pool has as many blocks as the rank with the least memory can
    hold, so that every rank's scheduler sees the same pool."""

    class Sharded(engine_class):  # type: ignore[valid-type, misc]
        def blocks_in_budget(self, config: EngineConfig) -> int:
            blocks = torch.tensor([super().blocks_in_budget(config)])
            if self.device.type == "cuda" and getattr(config, "kv_memory_gb", None) is None:
                # Ranks that share a GPU (gloo) each saw its whole free memory: each takes its part of it.
                blocks //= -(-dist.get_world_size() // torch.cuda.device_count())
            dist.all_reduce(blocks, op=dist.ReduceOp.MIN, group=control)
            return int(blocks)

    Sharded.__name__ = Sharded.__qualname__ = f"TensorParallel{engine_class.__name__}"
    return Sharded


def build_rank_engine(launch: Launch, step_name: str, config: EngineConfig,
                      loaded: LoadedModel | None = None) -> tuple[Engine, dist.ProcessGroup]:
    """Join the ranks, load the whole model (or take rank 0's), keep this rank's shard, build the engine."""
    device, control = join_ranks(launch)
    if loaded is None or loaded.model.device != device:
        loaded = load_model(config.model, device, config.resolved_dtype(), config.seed)
    shard_model(loaded.model, launch.rank, launch.world_size)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the other ranks' slices, loaded to be cut away
    engine_class = sharded_engine_class(find_step(step_name).engine_class(), control)
    return engine_class.on_own_model(loaded, dataclasses.replace(config, device=str(device))), control


class RankLog:
    """A digest of everything a rank's engine emitted: equal on every rank when the ranks stayed in step."""

    def __init__(self) -> None:
        self.digest = hashlib.blake2b(digest_size=16)

    def record(self, outputs: Sequence[RequestOutput]) -> None:
        for out in outputs:
            self.digest.update(f"{out.request_id}:{out.new_token_ids}:{out.finished};".encode())

    def report(self, rank: int, engine: Any) -> dict[str, Any]:
        """What the rank holds now: requests, blocks in use, and the digest of what it emitted."""
        return {"rank": rank, "requests": len(engine.requests), "running": len(engine.running),
                "waiting": len(engine.waiting), "blocks_used": engine.allocator.num_used,
                "blocks": engine.allocator.num_blocks, "emitted": self.digest.hexdigest()}


# Commands rank 0 broadcasts, each a tuple: ("add", prompt ids, params, request id, priority, arrival time),
# ("abort", request id), ("step",), ("report",), ("stop",).
Command = tuple[Any, ...]


JUST_STEP: list[Command] = [("step",)]


def send_commands(commands: list[Command], control: dist.ProcessGroup) -> None:
    """Rank 0's broadcast of the commands. Most steps bring nothing new: then one 8-byte broadcast says "step",
    and nothing is pickled."""
    payload = b"" if commands == JUST_STEP else pickle.dumps(commands)
    dist.broadcast(torch.tensor([len(payload)], dtype=torch.int64), src=0, group=control)
    if payload:
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=control)


def receive_commands(control: dist.ProcessGroup) -> list[Command]:
    """A worker's side of `send_commands`."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=0, group=control)
    if not int(size):
        return JUST_STEP
    payload = torch.empty(int(size), dtype=torch.uint8)
    dist.broadcast(payload, src=0, group=control)
    return pickle.loads(payload.numpy().tobytes())  # noqa: S301 (rank 0's own objects, over its own group)


def follow_rank_zero(launch: Launch, step_name: str, config: EngineConfig) -> None:
    """A worker rank: build the engine, then apply rank 0's commands until it says stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle: it stops the others
    watch_parent()
    quiet()
    engine, control = build_rank_engine(launch, step_name, config)
    log = RankLog()
    while True:
        for command in receive_commands(control):
            kind = command[0]
            if kind == "add":
                _, prompt_ids, params, request_id, priority, arrival = command
                engine.add_request(prompt_ids, params, request_id=request_id, priority=priority)
                engine.requests[request_id].arrival_time = arrival  # as on rank 0: the same order everywhere
            elif kind == "abort":
                engine.abort(command[1])
            elif kind == "step":
                log.record(engine.step())
            elif kind == "report":
                dist.gather_object(log.report(launch.rank, engine), None, dst=0, group=control)
            elif kind == "stop":  # the process ends here; rank 0 tears the group down once every rank has gone
                return


def quiet() -> None:
    """Rank 0 says what every rank does (start-up lines, reports): the others keep only their errors."""
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the life of the process)


def watch_parent() -> None:
    """Exit when the process that started this one is gone (killed without a chance to stop its workers)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="watch-parent").start()


def run_worker(launch: Launch, step_name: str, config: EngineConfig, errors: Connection | None = None) -> None:
    """The entry point of a spawned worker process. Its error, if it raises one, goes to rank 0 through `errors`
    (its traceback): a worker's stderr may be captured (pytest, a notebook) or lost, and rank 0 reports it."""
    try:
        follow_rank_zero(launch, step_name, config)
    except Exception as err:  # report it, then die: rank 0 sees the exit and stops the rest
        print(f"[rank {launch.rank}] {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        if errors is not None:
            errors.send(traceback.format_exc())
        raise SystemExit(1) from err


@dataclasses.dataclass
class Worker:
    """A spawned rank, and the read end of the pipe through which it sends its error's traceback if it fails."""

    process: BaseProcess
    errors: Connection
    error: str | None = None  # the traceback it sent, once read

    @property
    def rank(self) -> str:
        return self.process.name.removeprefix("rank-")

    def exit_report(self) -> str | None:
        """If the process exited with an error: which rank, its exit code and its traceback (if it sent one)."""
        code = self.process.exitcode
        if code in (None, 0):
            return None
        if self.error is None and self.errors.poll():
            try:
                self.error = self.errors.recv()
            except EOFError:  # the pipe closed with nothing in it: the process was killed
                self.error = ""
        said = (f"; its error:\n{self.error.rstrip()}" if self.error
                else " and reported no error (killed, or it died before Python could say why)")
        return f"rank {self.rank} exited with code {code}{said}"


def spawn_worker(launch: Launch, step_name: str, config: EngineConfig) -> Worker:
    """Start rank `launch.rank` in a new process (spawned: it imports the project afresh)."""
    spawn = mp.get_context("spawn")
    receive, send = spawn.Pipe(duplex=False)
    process = spawn.Process(target=run_worker, args=(launch, step_name, config, send), daemon=True,
                            name=f"rank-{launch.rank}")
    process.start()
    send.close()  # the child holds its own copy: the parent only reads
    return Worker(process, receive)


class TensorParallelEngine:
    """Rank 0's side of N processes that each run `step_name`'s engine on 1/N of the model. It offers the
    engine interface (add_request, step, abort, generate, stats, ...): what rank 0 is asked goes to the other
    ranks with the next step. Started with torchrun, the other ranks call `follow_rank_zero` themselves."""

    def __init__(self, step_name: str, config: EngineConfig, tensor_parallel_size: int,
                 backend: str | None = None) -> None:
        device_type = config.resolved_device().type
        backend = backend or ("nccl" if device_type == "cuda" else "gloo")
        check_splits(find_step(step_name), config, backend)
        torchrun = "RANK" in os.environ
        world = int(os.environ["WORLD_SIZE"]) if torchrun else tensor_parallel_size
        check_world(world, device_type, backend)
        # Rank 0 loads its model first, to refuse a size that does not divide it before anything is spawned.
        local = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local) if device_type == "cuda" else torch.device("cpu")
        loaded = load_model(config.model, device, config.resolved_dtype(), config.seed)
        check_divides(loaded.model.config, world)  # before any process is spawned
        self.world_size, self.stopping = world, False
        self.ranks: list[Worker] = []
        address = None if torchrun else free_address()
        if not torchrun:
            self.ranks = [spawn_worker(Launch(rank, world, device_type, address, backend), step_name, config)
                          for rank in range(1, world)]
            self.watcher = threading.Thread(target=self.watch_workers, daemon=True, name="watch-ranks")
            self.watcher.start()
        atexit.register(self.close)
        try:
            self.engine, self.control = build_rank_engine(Launch(0, world, device_type, address, backend),
                                                          step_name, config, loaded)
        except BaseException:
            self.close(graceful=False)  # the others would wait for rank 0 until the timeout
            raise
        self.pending: list[Command] = []
        self.log = RankLog()

    # ----- the engine interface: rank 0's engine, with every change also sent to the others -------------------

    def add_request(self, prompt: Any, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0, listener: Any = None) -> str:
        request_id = self.engine.add_request(prompt, params, request_id=request_id, priority=priority,
                                             listener=listener)
        request = self.engine.requests[request_id]  # tokenized, checked, its seed drawn: as the others need it
        self.pending.append(("add", request.prompt_token_ids, request.params, request_id, priority,
                             request.arrival_time))
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        out = self.engine.abort(request_id)
        if out is not None:
            self.pending.append(("abort", request_id))
        return out

    def step(self) -> list[RequestOutput]:
        try:
            self.send([*self.pending, ("step",)])
            self.pending = []
            outputs = self.engine.step()
        except (RuntimeError, dist.DistError) as err:  # a collective whose peer is gone
            self.raise_if_a_rank_died(err)
            raise
        self.log.record(outputs)
        return outputs

    generate = Engine.generate  # Engine's own loop, over this class's add_request and step

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def __getattr__(self, name: str) -> Any:  # the rest (requests, tokenizer, stats, ...) is rank 0's engine's
        if name == "engine":
            raise AttributeError(name)
        return getattr(self.engine, name)

    # ----- the ranks ------------------------------------------------------------------------------------------

    def send(self, commands: list[Command]) -> None:
        send_commands(commands, self.control)

    def rank_reports(self) -> list[dict[str, Any]]:
        """Every rank's `RankLog.report`, rank 0's first, once the commands so far have reached them all."""
        self.send([*self.pending, ("report",)])
        self.pending = []
        reports: list[dict[str, Any]] = [{}] * self.world_size
        dist.gather_object(self.log.report(0, self.engine), reports, dst=0, group=self.control)
        return reports

    @property
    def workers(self) -> list[BaseProcess]:
        """The other ranks' processes."""
        return [worker.process for worker in self.ranks]

    def dead_rank(self) -> str | None:
        """What to say of the first worker that exited, if one has: which, and its error."""
        for worker in self.ranks:
            if (report := worker.exit_report()) is not None:
                return f"stopping every rank: {report}"
        return None

    def raise_if_a_rank_died(self, err: Exception) -> None:
        """A collective failed: if a worker is gone, say so and stop the rest, rather than show gloo's error."""
        deadline = time.monotonic() + 5  # the failed collective may be seen before the dead process is
        while (message := self.dead_rank()) is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if message is not None:
            self.close(graceful=False)
            raise RankDiedError(message) from err

    def watch_workers(self) -> None:
        """A worker that dies while rank 0 waits in no collective (say, between requests) takes the others down
        with a clear error, rather than leaving them waiting."""
        while not self.stopping:
            message = self.dead_rank()
            if message is not None and not self.stopping:
                time.sleep(1.0)  # a step in flight fails and says it itself (raise_if_a_rank_died)
                if not self.stopping:
                    print(f"[rank 0] {message}", file=sys.stderr, flush=True)
                    self.kill_workers()
                    os._exit(1)
            time.sleep(0.2)

    def kill_workers(self) -> None:
        for worker in self.workers:
            if worker.is_alive():
                worker.kill()
            worker.join(timeout=10)

    def close(self, graceful: bool = True) -> None:
        """Stop every rank and wait for it: no process is left behind. Gracefully, the ranks are told to stop
        after their last command; a rank that does not answer within seconds (rank 0 was interrupted inside a
        collective, say by Ctrl-C) is killed."""
        if self.stopping:
            return
        self.stopping = True
        if graceful and "engine" in self.__dict__ and dist.is_initialized():
            stop = threading.Thread(target=self.stop_ranks, daemon=True, name="stop-ranks")
            stop.start()
            stop.join(timeout=10)
        for worker in self.workers:
            worker.join(timeout=10 if graceful else 0)
        self.kill_workers()
        if dist.is_initialized():  # every other rank is gone: nobody is left to see the connections close
            dist.destroy_process_group()

    def stop_ranks(self) -> None:
        self.send([("stop",)])

    def __enter__(self) -> TensorParallelEngine:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        self.close(graceful=exc_type is None)
