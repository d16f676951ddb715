"""`HypicLLM`: a LlamaIndex LLM whose separated prompt segments (and chat messages) are cached segments, and whose
prompts are cut around the chunks its runtime knows (`hypic_rag.prompting.matching`), so LlamaIndex's own engines reuse them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.generic_utils import (
    completion_response_to_chat_response,
    stream_completion_response_to_chat_response,
)
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM

from hypic_rag.errors import PromptTooLongError
from hypic_rag.integrations.llama_index.aio import in_thread, relay_stream
from hypic_rag.integrations.llama_index.runtime import DEFAULT_SEAM_TOKENS, HypicRuntime, runtime_for
from hypic_rag.prompting.matching import Piece, SegmentedPrompt
from hypic_rag.runtime.generation import Generation
from hypic_rag.runtime.modes import check_mode
from hypic_rag.runtime.sampling import SEED_MAX, SamplingParams
from hypic_rag.prompting.segments import DEFAULT_SEPARATOR, split_segments
from hypic_rag.pipeline.usage import usage_of

__all__ = ["MESSAGE_BOUNDARY", "HypicLLM", "segmented_messages_to_prompt"]

MESSAGE_BOUNDARY = "<<PIC_MSG>>"
"""Where `segmented_messages_to_prompt` ends a message: `HypicLLM` cuts the prompt there (each message is its own
segment) and, unlike at a separator, still looks for known chunks inside each message (a context chat engine
puts its retrieved nodes in the system message)."""

PREFIX_CHARS_PER_TOKEN = 8
"""A prompt longer than this many characters per token of the context window is first measured by its prefix of
that length (English text averages about 4 characters per token)."""


def segmented_messages_to_prompt(messages: Sequence[ChatMessage], boundary: str = MESSAGE_BOUNDARY) -> str:
    """Chat messages as `"{role}: {content}\n"` segments joined by `boundary` (`MESSAGE_BOUNDARY`): every message is
    its own (cached) segment; the last one, followed by the assistant's turn, is the query."""
    parts = [f"{message.role.value}: {message.content or ''}\n" for message in messages]
    if not parts:
        raise ValueError("no messages given")
    parts[-1] += "assistant:"
    return boundary.join(parts)


class HypicLLM(CustomLLM):
    """A LlamaIndex LLM that generates with hypic-rag (the bundled default model unless `model_path`).

    `complete(prompt)`: segments of the prompt separated by `separator` are cached and reused wherever they land;
    the last segment is the query. `chat(messages)`: each earlier message is its own cached segment
    (`segmented_messages_to_prompt`). With `match_segments` (the default) the text not marked by a separator (the
    query part; each message) is cut around the chunks the runtime knows (nodes of `HypicCacheTransformation`
    and `HypicQueryEngine`, segments seen), so LlamaIndex's own engines, which send one formatted prompt, reuse
    their entries. Usage (prompt, cached, recomputed, completion and matched tokens) is in
    `CompletionResponse.additional_kwargs` (streamed: in the last response). Generations go through the runtime's
    scheduler: concurrent calls (threads, or `acomplete` / `astream_complete` awaited together) are batched.
    """

    model_path: str | None = Field(default=None, description="Checkpoint directory; None: the bundled default model.")
    cache_dir: str | None = Field(default=None, description="Segment cache directory; None: an in-memory cache.")
    seam_tokens: int = Field(default=DEFAULT_SEAM_TOKENS, ge=0, description="Seam window recomputed per segment.")
    device: str | None = Field(default=None, description="cpu or cuda (None: cuda when available).")
    mode: str = Field(default="hypic", description="Assembly mode: hypic, transition_rope, ..., full.")
    max_new_tokens: int = Field(default=64, gt=0, description="Most tokens generated per call.")
    temperature: float = Field(default=0.0, ge=0.0, allow_inf_nan=False, description="0 is greedy.")
    seed: int | None = Field(
        default=None, ge=0, le=SEED_MAX,
        description="Makes sampling reproducible (0 to 2**64 - 1); None: every call samples afresh.",
    )
    separator: str = Field(default=DEFAULT_SEPARATOR, min_length=1, description="What separates prompt segments.")
    stop: list[str] | None = Field(
        default=None,
        description="Stop strings; None: the prompt format's answer stop (as HypicQueryEngine answers), []: none.",
    )
    match_segments: bool = Field(
        default=True, description="Cut prompts around the chunks the runtime knows, reusing their entries."
    )
    max_segments: int = Field(
        default=256, gt=0,
        description="Most segments (separated parts, chat messages) of one prompt; more raise PromptTooLongError.",
    )
    _runtime: HypicRuntime = PrivateAttr()

    def __init__(self, *, runtime: HypicRuntime | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("messages_to_prompt", segmented_messages_to_prompt)
        if kwargs.get("separator") == MESSAGE_BOUNDARY:
            raise ValueError(f"separator: {MESSAGE_BOUNDARY!r} marks message boundaries; choose another")
        super().__init__(**kwargs)
        check_mode(self.mode)
        self._runtime = runtime_for(runtime, self.model_path, self.cache_dir, self.seam_tokens, self.device)

    @classmethod
    def class_name(cls) -> str:
        return "HypicLLM"

    @property
    def runtime(self) -> HypicRuntime:
        return self._runtime

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self._runtime.context_window,
            num_output=self.max_new_tokens,
            is_chat_model=False,
            model_name=self._runtime.model_name,
        )

    def sampling(self, **kwargs: Any) -> SamplingParams:
        """Sampling for one call: `max_new_tokens` (or `max_tokens`), `temperature`, `seed`, `stop` override the
        fields. Without a seed, sampling (temperature > 0) draws fresh randomness on every call."""
        stop = kwargs.get("stop")
        if stop is None:
            stop = self.default_stop()
        return SamplingParams(
            max_new_tokens=int(kwargs.get("max_new_tokens", kwargs.get("max_tokens", self.max_new_tokens))),
            temperature=float(kwargs.get("temperature", self.temperature)),
            seed=kwargs.get("seed", self.seed),
            stop_strings=(stop,) if isinstance(stop, str) else tuple(stop),
        )

    def default_stop(self) -> tuple[str, ...]:
        """The stop strings of a call that names none: the `stop` field, else the prompt format's answer stop, so
        LlamaIndex's own engines get an answer that ends where the model ends it (not `max_new_tokens` later)."""
        if self.stop is not None:
            return tuple(self.stop)
        answer_stop = self._runtime.prompt_format.answer_stop
        return (answer_stop,) if answer_stop else ()

    def segmented(self, prompt: str, formatted: bool = False) -> SegmentedPrompt:
        """How `complete(prompt)` cuts the prompt: at `MESSAGE_BOUNDARY` into messages, each message at `separator`
        (every part but its last an explicit segment), and, with `match_segments`, each message's last part around
        the chunks the runtime knows."""
        if not formatted:
            prompt = self.completion_to_prompt(prompt)
        pieces: list[Piece] = []
        for message in prompt.split(MESSAGE_BOUNDARY):
            *marked, rest = split_segments(message, self.separator)
            pieces.extend(Piece(part, explicit=True) for part in marked)
            pieces.append(Piece(rest))
        return self._runtime.segmented_prompt(pieces, match=self.match_segments)

    def _complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """One completion, no events (the public methods send them); its usage (with how much of the prompt was
        matched to known chunks) in `additional_kwargs` and in `raw["usage"]`, where LlamaIndex's
        `TokenCountingHandler` reads token counts. `PromptTooLongError` before any model work for a prompt
        that does not fit the context window."""
        mode = check_mode(kwargs.get("mode", self.mode))
        params = self.sampling(**kwargs)
        prompt_segments = self._segmented_locked(prompt, formatted, params.max_new_tokens)
        generation = self._runtime.generate(prompt_segments.request, mode, params)
        return _completion_response(prompt_segments, generation, mode)

    def _segmented_locked(self, prompt: str, formatted: bool, max_new_tokens: int) -> SegmentedPrompt:
        """`segmented` under the runtime's lock (the tokenizer is shared with the scheduler's steps; never hold
        the lock while waiting for a generation: the scheduler takes it for every step), checked against the
        context window and `max_segments` (`PromptTooLongError`): first, cheaply, the text's own token count (one
        tokenizer pass over it, markers removed: about what its segments hold, before the cutting and matching,
        which take long on a huge prompt), refused when that alone exceeds the window; then the request's exact
        count with the new tokens."""
        with self._runtime.lock:
            text = prompt if formatted else self.completion_to_prompt(prompt)
            self._check_text_fits(text.replace(MESSAGE_BOUNDARY, "").replace(self.separator, ""))
            prompt_segments = self.segmented(text, formatted=True)
        request = prompt_segments.request
        self._check_fits(request.prompt_tokens, max_new_tokens)
        segments = len(request.chunk_ids) + 1
        if segments > self.max_segments:
            raise PromptTooLongError(f"the prompt has {segments} segments (separated parts or chat messages); "
                                     f"this LLM takes at most {self.max_segments} (max_segments): drop history")
        return prompt_segments

    def _check_text_fits(self, text: str) -> None:
        """`PromptTooLongError` when `text` alone has more tokens than the context window. A text longer than
        `PREFIX_CHARS_PER_TOKEN` characters per token of the window is refused as soon as that prefix of it is,
        so a huge prompt costs one short tokenizer pass."""
        window = self._runtime.context_window
        prefix_chars = window * PREFIX_CHARS_PER_TOKEN
        if len(text) > prefix_chars:
            prefix_tokens = len(self._runtime.tokenize(text[:prefix_chars]))
            if prefix_tokens > window:
                raise PromptTooLongError(
                    f"the prompt has {len(text)} characters, of which the first {prefix_chars} alone are "
                    f"{prefix_tokens} tokens; the model's context window is {window} tokens "
                    "(metadata.context_window): shorten the prompt or drop chat history")
        self._check_fits(len(self._runtime.tokenize(text)), 0, "about ")

    def _check_fits(self, prompt_tokens: int, max_new_tokens: int, about: str = "") -> None:
        """`PromptTooLongError` naming the length and the limit when the prompt and its new tokens exceed the
        model's context window."""
        window = self._runtime.context_window
        if prompt_tokens + max_new_tokens > window:
            asked = f" and asks for up to {max_new_tokens} new ones" if max_new_tokens else ""
            raise PromptTooLongError(
                f"the prompt has {about}{prompt_tokens} tokens{asked}; the model's context window is {window} tokens "
                "(metadata.context_window): shorten the prompt or drop chat history")

    async def _acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """`_complete` on an event loop: the prompt cut in a worker thread (it waits for the lock), the generation
        awaited from the scheduler (concurrent calls batch)."""
        mode = check_mode(kwargs.get("mode", self.mode))
        params = self.sampling(**kwargs)
        prompt_segments = await in_thread(self._segmented_locked, prompt, formatted, params.max_new_tokens)
        generation = await self._runtime.agenerate(prompt_segments.request, mode, params)
        return _completion_response(prompt_segments, generation, mode)

    def _stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        """The deltas of one completion, no events; a last item with an empty delta carries the usage (as
        `_complete`'s response does). `PromptTooLongError` at the call (not at the first item) for a prompt
        that does not fit."""
        mode = check_mode(kwargs.get("mode", self.mode))
        params = self.sampling(**kwargs)
        prompt_segments = self._segmented_locked(prompt, formatted, params.max_new_tokens)

        def generate() -> CompletionResponseGen:
            text = ""
            with self._runtime.stream(prompt_segments.request, mode, params) as deltas:
                for delta in deltas:
                    text += delta
                    yield CompletionResponse(text=text, delta=delta)
            generation = deltas.result
            usage = {**usage_of(generation), **prompt_segments.matching_usage(generation.prefill.segment_reused_tokens)}
            yield CompletionResponse(
                text=text, delta="",
                additional_kwargs={**usage, "finish_reason": generation.finish_reason, "mode": mode},
                raw={"usage": usage, "timings": dict(generation.timings)},
            )

        return generate()

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._complete(prompt, formatted, **kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        """Deltas that add up exactly to the text `complete` returns; the last item (empty delta) carries the
        usage."""
        return self._stream_complete(prompt, formatted, **kwargs)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        """`complete` awaited from the runtime's scheduler: the event loop keeps running meanwhile."""
        return await self._acomplete(prompt, formatted, **kwargs)

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        """`stream_complete` iterated in its own thread, the deltas relayed to the event loop."""
        items = await in_thread(self._stream_complete, prompt, formatted, **kwargs)
        return relay_stream(lambda: items)

    # Chat: the messages laid out as separated segments (`messages_to_prompt`), one LLM chat event per call (the
    # completion underneath sends none, so LlamaIndex's token counting sees each call once).
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return completion_response_to_chat_response(self._complete(self.messages_to_prompt(messages), True, **kwargs))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        items = self._stream_complete(self.messages_to_prompt(messages), True, **kwargs)
        return stream_completion_response_to_chat_response(items)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        response = await self._acomplete(self.messages_to_prompt(messages), True, **kwargs)
        return completion_response_to_chat_response(response)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        items = await in_thread(self._stream_complete, self.messages_to_prompt(messages), True, **kwargs)
        return relay_stream(lambda: stream_completion_response_to_chat_response(items))


def _completion_response(prompt_segments: SegmentedPrompt, generation: Generation, mode: str) -> CompletionResponse:
    """A completion's response: its text, and its usage (with how much of the prompt was matched to known chunks)
    in `additional_kwargs` and in `raw["usage"]`, where LlamaIndex's `TokenCountingHandler` reads token counts."""
    usage = {**usage_of(generation), **prompt_segments.matching_usage(generation.prefill.segment_reused_tokens)}
    return CompletionResponse(
        text=generation.text,
        additional_kwargs={**usage, "finish_reason": generation.finish_reason, "mode": mode},
        raw={"usage": usage, "timings": dict(generation.timings)},
    )
