"""LlamaIndex's LLM events for one hypic-rag generation, sent the way LlamaIndex's own LLM calls send them.

Both of LlamaIndex's channels see every call: the instrumentation dispatcher (`LLMCompletionStartEvent`,
`LLMCompletionInProgressEvent` per streamed delta, `LLMCompletionEndEvent`, `ExceptionEvent`) and the callback
manager (a `CBEventType.LLM` event whose end payload holds the prompt and the `CompletionResponse`). The response
carries the call's usage in `raw["usage"]` (OpenAI's key), which is where `TokenCountingHandler` reads prompt and
completion token counts; without it, it would count the prompt again with its own tokenizer.
"""

from __future__ import annotations

from typing import Any

from llama_index.core.base.llms.types import CompletionResponse
from llama_index.core.callbacks import CallbackManager, CBEventType, EventPayload
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.exception import ExceptionEvent
from llama_index.core.instrumentation.events.llm import (
    LLMCompletionEndEvent,
    LLMCompletionInProgressEvent,
    LLMCompletionStartEvent,
)
from llama_index.core.instrumentation.span import active_span_id

__all__ = ["completion_events", "completion_response"]

dispatcher = get_dispatcher(__name__)


def completion_response(text: str, usage: dict[str, int], **extra: Any) -> CompletionResponse:
    """A `CompletionResponse` of `text` whose usage LlamaIndex's token counting reads (`raw["usage"]`) and which
    keeps it, with `extra`, in `additional_kwargs` (where `HypicLLM` reports it)."""
    return CompletionResponse(text=text, raw={"usage": dict(usage)}, additional_kwargs={**usage, **extra})


class _CompletionEvents:
    """The events of one completion: `start` once, `progress` per streamed delta, then `end` or `fail`."""

    def __init__(self, payload: dict[str, Any], callback_manager: CallbackManager, prompt: str,
                 options: dict[str, Any]) -> None:
        self._payload = payload
        self._callback_manager = callback_manager
        self._prompt = prompt
        self._options = options
        self._span_id: str | None = None
        self._event_id = ""

    def start(self) -> None:
        self._span_id = active_span_id.get()
        dispatcher.event(LLMCompletionStartEvent(
            model_dict=self._payload, prompt=self._prompt, additional_kwargs=self._options, span_id=self._span_id,
        ))
        self._event_id = self._callback_manager.on_event_start(
            CBEventType.LLM,
            payload={EventPayload.PROMPT: self._prompt, EventPayload.ADDITIONAL_KWARGS: self._options,
                     EventPayload.SERIALIZED: self._payload},
        )

    def progress(self, text: str, delta: str) -> None:
        """`text`: the answer so far; `delta`: what this step added."""
        dispatcher.event(LLMCompletionInProgressEvent(
            prompt=self._prompt, response=CompletionResponse(text=text, delta=delta), span_id=self._span_id,
        ))

    def end(self, response: CompletionResponse) -> None:
        self._callback_manager.on_event_end(
            CBEventType.LLM,
            payload={EventPayload.PROMPT: self._prompt, EventPayload.COMPLETION: response},
            event_id=self._event_id,
        )
        dispatcher.event(LLMCompletionEndEvent(prompt=self._prompt, response=response, span_id=self._span_id))

    def fail(self, error: BaseException) -> None:
        self._callback_manager.on_event_end(
            CBEventType.LLM, payload={EventPayload.EXCEPTION: error}, event_id=self._event_id
        )
        dispatcher.event(ExceptionEvent(exception=error, span_id=self._span_id))


def completion_events(
    llm: Any, callback_manager: CallbackManager, prompt: str, options: dict[str, Any]
) -> _CompletionEvents:
    """The events of one completion of `prompt` (the text the model reads, all segments in order) by `llm`
    (`to_payload()` describes it), sent to the dispatcher and to `callback_manager`; `options` are the call's
    settings (`additional_kwargs` of the start event). Call `start()` first."""
    return _CompletionEvents(llm.to_payload(), callback_manager, prompt, options)
