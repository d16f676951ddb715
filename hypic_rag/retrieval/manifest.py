"""The index manifest: what built an index and what it holds, in `manifest.json`.

It records the embedder identity (and the embedder's directory unless it is the shipped default), the chunker
settings, the whole prompt format (its chunk template decides the stored token ids, its prefix the prefix segment's
cache entry, its question template and answer stop how questions are asked), the model and tokenizer fingerprints
and the dtype the model ran in (which decide the cache entries), the seam width the cache was encoded with, the
FAISS settings, where the segment cache lives, the cache format its entries are stored in (`cache_format`: chosen by
precompute's `--cache-format`, kept until precompute rebuilds the cache in another; absent in older manifests:
float32), counts, the recompute policy `ask` and `serve` use for it (`recompute_policy`: set by `hypic-rag
calibrate`; absent: the fixed seam), the cache format calibration recommends (`cache_format_choice`) and, for an
index of the bundled demo model, how its chunks fit that model's synthetic world (`bundled_model_fit`,
`hypic_rag.demo.world`), and how it embeds and expands chunks (`retrieval`: `chunk_context.RetrievalSettings`;
absent in older manifests: the chunk's text alone, no expansion). Opening an index with another embedder, model, tokenizer, chunker setting or prompt format
is refused with an `IndexMismatchError` that names the difference.

A manifest written before the whole format was recorded holds only `chunk_template`: it reads as that template
with the default prefix, question template and answer stop (what `ask` and `serve` used for it then). The
`chunk_template` key is still written, for readers of that older layout.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hypic_rag.demo.world import CorpusFit
from hypic_rag.entry.schema import check_seam_tokens
from hypic_rag.entry.compression import DEFAULT_CACHE_FORMAT, cache_format
from hypic_rag.prompting.layout import DEFAULT_PROMPT_FORMAT, PromptFormat
from hypic_rag.retrieval.chunk_context import LEGACY_RETRIEVAL, RetrievalSettings
from hypic_rag.retrieval.embeddings import EmbedderIdentity
from hypic_rag.retrieval.errors import IndexCorruptError, IndexMismatchError, IndexNotFoundError
from hypic_rag.retrieval.faiss_index import VectorIndexConfig
from hypic_rag.runtime.recompute_policy import RecomputePolicy

logger = logging.getLogger(__name__)

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class ModelIdentity:
    """The generation model an index's token ids and cache entries belong to.

    dtype: the dtype the model was loaded in ("float32", "bfloat16", "float16"); `ask` and `serve` load it so
    again unless told otherwise. None in a manifest written before fingerprints were exact (hypic-rag < 0.2 hashed
    a float sum that changed with the thread count): such a fingerprint cannot be checked, see `check_model`.
    """

    path: str
    fingerprint: str
    tokenizer_fingerprint: str
    dtype: str | None = None

    def __post_init__(self) -> None:
        if not self.fingerprint or not self.tokenizer_fingerprint:
            raise ValueError("model and tokenizer fingerprints must be non-empty")

    @classmethod
    def of(cls, path: str | Path, model: Any) -> ModelIdentity:
        """The identity of a loaded `HybridModel` read from `path`."""
        return cls(str(path), model.fingerprint, model.tokenizer_fingerprint, model.dtype_name)

    @property
    def legacy(self) -> bool:
        """Recorded before fingerprints were exact (no dtype recorded): its fingerprint cannot be compared."""
        return self.dtype is None


@dataclass(slots=True)
class IndexManifest:
    """Contents of `manifest.json` (see the module docstring)."""

    embedder: EmbedderIdentity
    model: ModelIdentity
    chunker: dict[str, Any]
    prompt_format: PromptFormat
    seam_tokens: int
    vector_index: VectorIndexConfig
    cache_dir: str
    embedder_path: str | None = None
    counts: dict[str, int] = field(default_factory=lambda: {"documents": 0, "chunks": 0, "tokens": 0})
    format_version: int = MANIFEST_FORMAT_VERSION
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    recompute_policy: dict[str, Any] | None = None
    cache_format: str = DEFAULT_CACHE_FORMAT
    cache_format_choice: dict[str, Any] | None = None
    bundled_model_fit: dict[str, Any] | None = None
    """How the chunks fit the bundled demo model's world (`hypic_rag.demo.world.CorpusFit.to_dict()`), measured by
    precompute for an index of the bundled model; None for any other model (and in older manifests)."""
    retrieval: dict[str, Any] | None = None
    """How chunks were embedded and hits are expanded (`RetrievalSettings.to_dict()`); None in a manifest written
    before it was recorded (`LEGACY_RETRIEVAL`)."""

    def __post_init__(self) -> None:
        check_seam_tokens(self.seam_tokens)
        if self.bundled_model_fit is not None:
            CorpusFit.from_dict(self.bundled_model_fit)  # a malformed record: an error (IndexCorruptError on load)
        cache_format(self.cache_format)  # an unknown name: ValueError (IndexCorruptError on load)
        if self.cache_format_choice is not None:
            if not isinstance(self.cache_format_choice, dict):
                raise ValueError(f"cache_format_choice must be an object, got {self.cache_format_choice!r}")
            cache_format(self.cache_format_choice.get("cache_format"))
        if self.recompute_policy is not None:
            if not isinstance(self.recompute_policy, dict) or not isinstance(self.recompute_policy.get("policy"), str):
                raise ValueError(f"recompute_policy must be an object with a policy spec, got {self.recompute_policy!r}")
            RecomputePolicy.parse(self.recompute_policy["policy"])  # a bad spec: ValueError (IndexCorruptError on load)
        if self.retrieval is not None:
            if not isinstance(self.retrieval, dict):
                raise ValueError(f"retrieval must be an object, got {self.retrieval!r}")
            RetrievalSettings.from_dict(self.retrieval)  # unknown kinds: ValueError (IndexCorruptError on load)
        if self.format_version != MANIFEST_FORMAT_VERSION:
            raise IndexMismatchError(
                f"index format version {self.format_version} is not supported (expected {MANIFEST_FORMAT_VERSION})"
            )

    @property
    def recompute_policy_spec(self) -> str | None:
        """The recompute policy recorded for this index (`hypic-rag calibrate`), or None (the fixed seam)."""
        return None if self.recompute_policy is None else str(self.recompute_policy["policy"])

    @property
    def retrieval_settings(self) -> RetrievalSettings:
        """How this index's chunks were embedded and its hits are expanded by default (`LEGACY_RETRIEVAL` for an
        index built before this was recorded)."""
        return LEGACY_RETRIEVAL if self.retrieval is None else RetrievalSettings.from_dict(self.retrieval)

    @property
    def corpus_fit(self) -> CorpusFit | None:
        """`bundled_model_fit` as a `CorpusFit` (None when not measured)."""
        return None if self.bundled_model_fit is None else CorpusFit.from_dict(self.bundled_model_fit)

    @property
    def chunk_template(self) -> str:
        """The prompt format's chunk template (what decides the stored token ids)."""
        return self.prompt_format.chunk_template

    def cache_path(self, index_dir: Path) -> Path:
        """The segment cache directory (stored relative to the index directory when inside it)."""
        return (index_dir / self.cache_dir).resolve()

    # ------------------------------------------------------------------------- compatibility
    def check_embedder(self, embedder: EmbedderIdentity) -> None:
        if embedder != self.embedder:
            raise IndexMismatchError(
                f"index was built with embedder {self.embedder.name} ({self.embedder.dimension} dims, digest "
                f"{self.embedder.digest[:12]}), not {embedder.name} ({embedder.dimension} dims, digest "
                f"{embedder.digest[:12]}); use the same embedder or a new index directory"
            )

    def check_model(self, model: ModelIdentity) -> None:
        """Refuse another model, tokenizer or dtype with an `IndexMismatchError` naming the difference.

        A legacy identity (see `ModelIdentity`) of the same checkpoint directory and tokenizer is accepted: its
        fingerprint cannot be checked, its cache entries are keyed by the old fingerprint and simply no longer hit
        (invalidated once), and the token ids stay valid. `adopt_model` records the new identity.
        """
        same_tokenizer = model.tokenizer_fingerprint == self.model.tokenizer_fingerprint
        if same_tokenizer and self.model.legacy and not model.legacy and _same_path(self.model.path, model.path):
            return
        if self.model.dtype is not None and model.dtype is not None and model.dtype != self.model.dtype:
            raise IndexMismatchError(
                f"index was built for model {self.model.path} in {self.model.dtype}, not {model.dtype}; "
                f"pass --dtype {self.model.dtype} (or leave --dtype out) or use a new index directory"
            )
        if model.fingerprint != self.model.fingerprint:
            raise IndexMismatchError(
                f"index was built for model {self.model.path} (fingerprint {self.model.fingerprint[:12]}), not "
                f"{model.path} (fingerprint {model.fingerprint[:12]}); use that model or a new index directory"
            )
        if not same_tokenizer:
            raise IndexMismatchError(
                f"index was built with another tokenizer (fingerprint {self.model.tokenizer_fingerprint[:12]}, "
                f"given {model.tokenizer_fingerprint[:12]}); use the same model or a new index directory"
            )

    def check_loaded_model(self, path: str | Path, model: Any) -> None:
        """`check_model` for a loaded `HybridModel` read from `path`."""
        self.check_model(ModelIdentity.of(path, model))

    def adopt_model(self, model: ModelIdentity) -> bool:
        """`check_model`, then record `model` in place of a legacy identity; True when the manifest changed
        (the caller saves it)."""
        self.check_model(model)
        if not self.model.legacy or model.legacy:
            return False
        logger.warning(
            "the index manifest predates exact model fingerprints: recording %s (%s); its cache entries are "
            "encoded again once", model.path, model.dtype,
        )
        self.model = model
        return True

    def check_chunking(self, chunker: dict[str, Any], chunk_template: str, seam_tokens: int) -> None:
        if chunker != self.chunker:
            raise IndexMismatchError(
                f"index was built with chunker settings {self.chunker}, not {chunker}; pass the same "
                f"--chunk-tokens ({self.chunker.get('chunk_tokens')}) or use a new index directory"
            )
        if chunk_template != self.chunk_template:
            raise IndexMismatchError(f"index was built with chunk template {self.chunk_template!r}, not {chunk_template!r}")
        if seam_tokens != self.seam_tokens:
            raise IndexMismatchError(
                f"index cache was encoded with seam_tokens={self.seam_tokens}, not {seam_tokens}; "
                "use the same seam width or a new index directory"
            )

    def check_prompt_format(self, prompt_format: PromptFormat) -> None:
        """Refuse another prompt format: its chunk template decides the stored token ids (`check_chunking` names
        that difference), its prefix the prefix's cache entry, and the rest how the index is asked."""
        if prompt_format != self.prompt_format:
            raise IndexMismatchError(
                f"index was built with prompt format {self.prompt_format.to_dict()}, not {prompt_format.to_dict()}; "
                "use the same prompt format or a new index directory"
            )

    def check_cache_format(self, given: str | None, index_dir: str | Path = "DIR") -> str:
        """The index's cache format; `IndexMismatchError` in one line when `given` (None: no wish) is another one:
        an index keeps the format its cache was built in until precompute rebuilds it."""
        if given is not None and given != self.cache_format:
            raise IndexMismatchError(
                f"index {index_dir} keeps its cache entries in format {self.cache_format}, not {given}; leave "
                f"--cache-format out, or rebuild its cache in {given} with `hypic-rag precompute CORPUS --index "
                f"{index_dir} --cache-format {given}`"
            )
        return self.cache_format

    def check_embedding_context(self, settings: RetrievalSettings) -> None:
        """Refuse `settings` whose embedding context is not the one this index's vectors were made with (its
        neighbour expansion may differ: that is chosen per query)."""
        built = self.retrieval_settings.embedding_context
        if settings.embedding_context != built:
            raise IndexMismatchError(
                f"index embedded its chunks with embedding context {built!r}, not {settings.embedding_context!r}; "
                f"pass --embedding-context {built} (or leave it out) or use a new index directory"
            )

    def check_vector_index(self, config: VectorIndexConfig) -> None:
        if config.kind != self.vector_index.kind:
            raise IndexMismatchError(
                f"index uses a {self.vector_index.kind!r} FAISS index, not {config.kind!r}; use a new index directory"
            )

    # --------------------------------------------------------------------------- persistence
    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["prompt_format"] = self.prompt_format.to_dict()
        data["chunk_template"] = self.prompt_format.chunk_template  # what readers of the older layout read
        data["embedder"] = self.embedder.to_dict()
        data["vector_index"] = self.vector_index.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> IndexManifest:
        return cls(
            embedder=EmbedderIdentity.from_dict(data["embedder"]),
            model=ModelIdentity(**data["model"]),
            chunker=dict(data["chunker"]),
            prompt_format=_prompt_format_of(data),
            seam_tokens=int(data["seam_tokens"]),
            vector_index=VectorIndexConfig.from_dict(data["vector_index"]),
            cache_dir=str(data["cache_dir"]),
            embedder_path=data.get("embedder_path"),
            counts={key: int(value) for key, value in data["counts"].items()},
            format_version=int(data["format_version"]),
            created_at=float(data["created_at"]),
            updated_at=float(data["updated_at"]),
            recompute_policy=data.get("recompute_policy"),
            cache_format=str(data.get("cache_format", DEFAULT_CACHE_FORMAT)),
            cache_format_choice=data.get("cache_format_choice"),
            bundled_model_fit=data.get("bundled_model_fit"),
            retrieval=data.get("retrieval"),
        )

    def save(self, index_dir: Path) -> None:
        """Write `manifest.json` atomically."""
        self.updated_at = time.time()
        path = index_dir / MANIFEST_FILE
        temporary = path.with_name(path.name + ".tmp")
        try:
            temporary.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n", encoding="utf-8")
            os.replace(temporary, path)
        except BaseException:  # disk full: leave the old file, and no partial temporary one
            temporary.unlink(missing_ok=True)
            raise

    @classmethod
    def load(cls, index_dir: Path) -> IndexManifest:
        """Read `manifest.json`; IndexNotFoundError when absent, IndexCorruptError when unreadable."""
        path = index_dir / MANIFEST_FILE
        if index_dir.exists() and not index_dir.is_dir():
            raise IndexNotFoundError(f"{str(index_dir)!r} is a file, not an index directory; run precompute first")
        if not path.is_file():
            raise IndexNotFoundError(f"{str(index_dir)!r} holds no index (no {MANIFEST_FILE}); run precompute first")
        try:
            return cls.from_dict(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise IndexCorruptError(f"cannot read {path}: {error}") from error


def _prompt_format_of(data: dict[str, Any]) -> PromptFormat:
    """The recorded prompt format; a manifest without one (the older layout) recorded only the chunk template,
    and was asked with the default prefix, question template and answer stop."""
    recorded = data.get("prompt_format")
    if recorded is None:
        return PromptFormat(
            prefix=DEFAULT_PROMPT_FORMAT.prefix,
            chunk_template=str(data["chunk_template"]),
            question_template=DEFAULT_PROMPT_FORMAT.question_template,
            answer_stop=DEFAULT_PROMPT_FORMAT.answer_stop,
        )
    if not isinstance(recorded, dict):
        raise ValueError(f"prompt_format must be an object, not {type(recorded).__name__}")
    return PromptFormat.from_dict(recorded)


def _same_path(first: str, second: str) -> bool:
    try:
        return Path(first).expanduser().resolve() == Path(second).expanduser().resolve()
    except (OSError, RuntimeError):
        return first == second
