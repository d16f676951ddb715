"""Continuous batching between the callers (service, pipeline, LlamaIndex integration) and the runtime.

`Scheduler` (scheduler.py) takes generations into a waiting queue and runs them in batched steps; its limits are
`SchedulerConfig` (config.py); `Sequence` (sequence.py) is one generation inside it; handles.py has the sinks that
hand tokens to a consumer thread, an event loop or callbacks.
"""

from hypic_rag.runtime.scheduler.config import SchedulerConfig
from hypic_rag.runtime.scheduler.handles import AsyncQueueSink, CallbackSink, QueueSink
from hypic_rag.runtime.scheduler.scheduler import Scheduler, StepReport
from hypic_rag.runtime.scheduler.sequence import SchedulerFullError, SchedulerStopped, Sequence, SequenceCancelled, SequenceSink

__all__ = [
    "AsyncQueueSink",
    "CallbackSink",
    "QueueSink",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerFullError",
    "SchedulerStopped",
    "Sequence",
    "SequenceCancelled",
    "SequenceSink",
    "StepReport",
]
