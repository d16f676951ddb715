"""The state the LlamaIndex components share: one `ModelSession` per model and cache directory, with its scheduler.

Every generation of the LLM and the query engine goes through the runtime's `Scheduler` (continuous batching), so
concurrent ones, from threads or async queries (`acomplete`, `aquery`), run together in batched steps."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Generator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path

from hypic_rag.runtime.engine import PrefillStats
from hypic_rag.runtime.generation import Generation
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.sampling import SamplingParams
from hypic_rag.runtime.scheduler import AsyncQueueSink
from hypic_rag.pipeline.session import DEFAULT_SEAM_TOKENS, ModelSession
from hypic_rag.utils.streaming import ResultStream

__all__ = ["DEFAULT_SEAM_TOKENS", "HypicRuntime", "runtime_for"]


class HypicRuntime(ModelSession):
    """A model, its engine, segment cache (persistent in `cache_dir`, else in memory) and prompt format (a
    `ModelSession`), shared by the LLM, the query engine and the ingestion transformation. Generations go through
    the session's `scheduler` (started on first use, in a thread of its own), so concurrent ones batch; the engine
    is not thread-safe, so anything else that uses it (precompute) holds `lock`, the lock the scheduler holds during
    each step. `HypicRuntime.open(model_path, cache_dir=..., seam_tokens=..., device=...)` loads one (None: the bundled
    default model)."""

    _shared: dict[tuple[str, str | None, int, str | None], HypicRuntime] = {}
    _shared_lock = threading.Lock()

    @classmethod
    def shared(
        cls, model_path: str | Path | None = None, *, cache_dir: str | Path | None = None,
        seam_tokens: int = DEFAULT_SEAM_TOKENS, device: str | None = None,
    ) -> HypicRuntime:
        """One runtime per (model, cache directory, seam width, device) in this process, opened on first use
        (a cache directory can be open only once per process)."""
        from hypic_rag.demo.default_model import resolve_model_path

        key = (
            str(resolve_model_path(model_path).resolve()),
            str(Path(cache_dir).expanduser().resolve()) if cache_dir is not None else None,
            seam_tokens,
            device,
        )
        with cls._shared_lock:
            runtime = cls._shared.get(key)
            if runtime is None:
                runtime = cls.open(key[0], cache_dir=key[1], seam_tokens=seam_tokens, device=device)
                cls._shared[key] = runtime
            return runtime  # type: ignore[return-value]

    @property
    def lock(self) -> AbstractContextManager[bool]:
        """The lock the scheduler holds during each step: hold it to use the engine between steps."""
        return self.scheduler.lock

    def close(self) -> None:
        """Stop the scheduler, close the segment cache (if any) and forget this runtime in the shared registry."""
        with self._shared_lock:
            for key, runtime in list(self._shared.items()):
                if runtime is self:
                    del self._shared[key]
        super().close()

    # ------------------------------------------------------------------------------------------- tokens
    def tokenize(self, text: str) -> list[int]:
        """Token ids of `text` alone (no special tokens); usable as a LlamaIndex splitter's `tokenizer`.
        ValueError when `text` holds a lone surrogate."""
        return self.tokenize_segment(text)

    def rag_request(self, texts: Sequence[str], question: str) -> Request:
        """The prompt prefix, one segment per text (formatted as a retrieved chunk), then the question, each
        tokenized on its own (`ModelSession.request`). The texts become known chunks: a later prompt holding one
        without separators reuses its entry (`ModelSession.know_chunks`)."""
        if not question.strip():
            raise ValueError("the question is empty")
        request = self.request(question, [self.chunk_ids(text) for text in texts])
        self.know_chunks(texts)
        return request

    # ------------------------------------------------------------------------------------------- work
    def precompute(self, segments: Sequence[Sequence[int]], *, include_prefix: bool = False) -> PrefillStats:
        """Make the cache hold the entries hypic mode will ask for: each chunk segment's (for the seam width)
        and, with `include_prefix`, the prompt prefix's (`ModelSession.fill_cache`). Missing ones are encoded and
        stored; hits and misses are counted per segment given."""
        with self.lock:
            report = self.fill_cache(self.plan(segments, include_prefix=include_prefix, distinct=False))
        return PrefillStats(
            mode="hypic", cache_hits=report.cache_hits, cache_misses=report.cache_misses,
            total_seconds=report.seconds,
        )

    def generate(self, request: Request, mode: str, params: SamplingParams) -> Generation:
        """The `Generation` of `request`, batched with whatever else is generating."""
        return self.scheduler.start().generate(request, mode, params)

    def stream(self, request: Request, mode: str, params: SamplingParams) -> ResultStream[str, Generation]:
        """Non-empty text deltas as they are generated (batched with whatever else is generating); closing the
        stream early stops the generation; its `.result` is the `Generation`."""

        def deltas() -> Generator[str, None, Generation]:
            with self.scheduler.start().stream(request, mode, params) as inner:
                for _, delta in inner:
                    if delta:
                        yield delta
                return inner.result

        return ResultStream(deltas())

    async def agenerate(self, request: Request, mode: str, params: SamplingParams) -> Generation:
        """`generate` for an event loop: awaits the scheduler without blocking the loop, so concurrent async
        queries batch (a cancelled await cancels the generation)."""
        sink = AsyncQueueSink(asyncio.get_running_loop())
        sequence = self.scheduler.start().submit(request, mode, params, sink=sink)
        try:
            return await sink.future
        finally:
            if not sink.future.done():
                sequence.cancel()

    async def astream(self, request: Request, mode: str, params: SamplingParams) -> AsyncGenerator[str, None]:
        """Non-empty text deltas on an event loop (stopping early cancels the generation); raises what the
        generation raised."""
        sink = AsyncQueueSink(asyncio.get_running_loop())
        sequence = self.scheduler.start().submit(request, mode, params, sink=sink)
        async for _, delta in sink.events(sequence):
            if delta:
                yield delta
        await sink.future


def runtime_for(
    runtime: HypicRuntime | None, model_path: str | None, cache_dir: str | None, seam_tokens: int, device: str | None
) -> HypicRuntime:
    """`runtime`, else the shared runtime of these settings (`HypicRuntime.shared`)."""
    return runtime if runtime is not None else HypicRuntime.shared(
        model_path, cache_dir=cache_dir, seam_tokens=seam_tokens, device=device
    )
