"""hypic-rag: position-independent caching for hybrid-attention LLMs.

Everything a Python user needs is importable from here (the front door); the submodules are the implementation.

Answer questions over a corpus (the README's "Python" section shows it whole):
- `build_index(corpus, index_dir)`: precompute an index of a folder of documents: chunk, embed, and encode every
  chunk into the segment cache once (what `hypic-rag precompute` runs); rerun, it does only what changed.
- `RagPipeline.open(index_dir)`: an index with the model, segment cache and prompt format it was built for;
  `answer(question)` returns an `Answer` (text, `Source`s, usage, timings), `stream(question)` yields the sources,
  then the answer's text as it is generated.
- `SamplingParams`: how an answer is generated (max tokens, temperature, stop strings, ...).

Compose segments yourself (no index, no retrieval):
- `load_model`: a checkpoint directory, a transformers model object (used as it is and left as it was) or a
  config, as a `HybridModel`.
- `Engine`: prefill and generation of a `Request` (prompt prefix, chunk segments, question; token ids) in any mode
  (`full`, `hypic`, ...), composing cached chunk entries; `generate` returns a `Generation`.
- `ModelSession`: a model with its engine, segment cache and `PromptFormat` (`DEFAULT_PROMPT_FORMAT`), which
  builds requests from text.

Serve and try: `ServerConfig` and `ServerThread` (the REST service in a background thread; `hypic-rag serve` runs it
in the foreground), `DEFAULT_SEPARATOR` (between the segments of a prompt sent to `/v1/completions`),
`default_model_path` and `example_corpus_path` (the bundled model and its corpus), `read_questions` (that corpus's
questions with their answers). Every error raised on purpose is a `HypicError`. LlamaIndex users import from
`hypic_rag.integrations.llama_index`.

Importing this package is light: each name is imported from its module on first use (torch and transformers load
only then), so `hypic-rag --help` stays fast.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from hypic_rag.version import __version__

__all__ = [
    "__version__",
    # answering over an index
    "build_index",
    "RagPipeline",
    "Answer",
    "Source",
    "SamplingParams",
    # composing segments
    "load_model",
    "HybridModel",
    "Engine",
    "Request",
    "Generation",
    "ModelSession",
    "PromptFormat",
    "DEFAULT_PROMPT_FORMAT",
    # serving and trying
    "ServerConfig",
    "ServerThread",
    "DEFAULT_SEPARATOR",
    "default_model_path",
    "example_corpus_path",
    "read_questions",
    "HypicError",
]

_HOMES: dict[str, str] = {
    "build_index": "hypic_rag.pipeline.precompute",
    "RagPipeline": "hypic_rag.pipeline.answering",
    "Answer": "hypic_rag.pipeline.answering",
    "Source": "hypic_rag.pipeline.answering",
    "SamplingParams": "hypic_rag.runtime.sampling",
    "load_model": "hypic_rag.runtime.model",
    "HybridModel": "hypic_rag.runtime.model",
    "Engine": "hypic_rag.runtime.engine",
    "Request": "hypic_rag.runtime.request",
    "Generation": "hypic_rag.runtime.generation",
    "ModelSession": "hypic_rag.pipeline.session",
    "PromptFormat": "hypic_rag.prompting.layout",
    "DEFAULT_PROMPT_FORMAT": "hypic_rag.prompting.layout",
    "ServerConfig": "hypic_rag.server",
    "ServerThread": "hypic_rag.server.runner",
    "DEFAULT_SEPARATOR": "hypic_rag.server",
    "default_model_path": "hypic_rag.demo.default_model",
    "example_corpus_path": "hypic_rag.demo.default_model",
    "read_questions": "hypic_rag.demo.example_corpus",
    "HypicError": "hypic_rag.errors",
}
"""Each front-door name -> the module that defines it, imported on first use (`__getattr__`)."""

if TYPE_CHECKING:
    from hypic_rag.demo.default_model import default_model_path, example_corpus_path
    from hypic_rag.errors import HypicError
    from hypic_rag.demo.example_corpus import read_questions
    from hypic_rag.pipeline.answering import Answer, RagPipeline, Source
    from hypic_rag.pipeline.precompute import build_index
    from hypic_rag.prompting.layout import DEFAULT_PROMPT_FORMAT, PromptFormat
    from hypic_rag.runtime.engine import Engine
    from hypic_rag.runtime.generation import Generation
    from hypic_rag.runtime.model import HybridModel, load_model
    from hypic_rag.runtime.request import Request
    from hypic_rag.runtime.sampling import SamplingParams
    from hypic_rag.server import DEFAULT_SEPARATOR, ServerConfig
    from hypic_rag.server.runner import ServerThread
    from hypic_rag.pipeline.session import ModelSession


def __getattr__(name: str) -> Any:
    """A front-door name, imported from its module on first use (PEP 562) and kept in the package's namespace."""
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})

