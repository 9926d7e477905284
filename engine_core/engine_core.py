"""EngineCore: the one synchronous engine step, shared by every way of running an engine.

    outputs = core.step():
        batch   = scheduler.schedule()                # admit, allocate pages, pick chunks (may preempt)
        logits  = runner.forward(batch.chunks)        # the model, one mixed batch
        outputs = scheduler.process(batch, logits)    # sample, append, detect the end, free pages
        + scheduler.take_outputs()                    # errors and aborts raised outside `process`
        + scheduler.take_kv_events()                  # what the prefix cache stored / evicted
        + scheduler.take_started()                    # requests taken out of the queue this step

Who drives it: the serving loop (`engine_core.step_loop.StepLoop`, from its own thread), the offline
`engine_core.llm.LLM`, the engine benchmarks (`loadtests/engine_bench`) and the tests. Any scheduler
that satisfies `engine_core.scheduler_protocol.Scheduler` plugs in; EngineCore itself knows nothing of
pages, caches or beams. Not thread-safe: one thread calls `add`, `abort` and `step`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine_core.request import KvEvent, Request, StepOutput
from engine_core.scheduler_protocol import Runner, Scheduler


@dataclass
class StepResult:
    outputs: list[StepOutput] = field(default_factory=list)
    kv_events: list[KvEvent] = field(default_factory=list)
    ran_model: bool = False  # a forward pass ran (False: nothing was runnable)
    started: list[str] = field(default_factory=list)  # request ids scheduled out of the queue this step
    prefill_tokens: int = 0  # tokens of multi-token chunks (prompt prefill) in this step's forward
    decode_tokens: int = 0  # one-token chunks (decode) in this step's forward

    @property
    def did_work(self) -> bool:
        return self.ran_model or bool(self.outputs)


class EngineCore:
    def __init__(self, scheduler: Scheduler, runner: Runner) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.num_steps = 0  # steps that ran the model

    def add(self, request: Request) -> None:
        """Validate (InvalidRequestError / CapacityError, nothing queued) and queue the request."""
        self.scheduler.validate(request)
        self.scheduler.add(request)

    def abort(self, request_id: str) -> bool:
        """Drop the request and free its pages now; False when it is unknown or finished."""
        return self.scheduler.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> StepResult:
        result = StepResult()
        batch = self.scheduler.schedule() if self.scheduler.has_unfinished() else None
        result.outputs += self.scheduler.take_outputs()
        result.started = self.scheduler.take_started()
        if batch is not None and batch.chunks:
            for chunk in batch.chunks:
                n = len(getattr(chunk, "token_ids", ()))  # a scheduler's own chunk type counts as decode
                if n > 1:
                    result.prefill_tokens += n
                else:
                    result.decode_tokens += 1
            logits = self.runner.forward(batch.chunks)
            result.outputs += self.scheduler.process(batch, logits)
            result.outputs += self.scheduler.take_outputs()
            result.ran_model = True
            self.num_steps += 1
        result.kv_events = self.scheduler.take_kv_events()
        return result
