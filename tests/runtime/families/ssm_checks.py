"""What every Mamba-family hybrid (jamba, bamba, nemotron_h, falcon_h1, zamba2) must satisfy on tiny random fp32
models (issue 18, "What must hold") beyond the checks every family runs (test_every_family.py), as plain functions
the per-family test files call with their own models."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hypic_rag.entry.schema import tensor_name
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.model import load_model
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.sampling import SamplingParams
from hypic_rag.cli.in_process import run_cli_here
from hypic_rag.testing import train_tiny_tokenizer
from kits.corpora import SMALL_CORPUS, SMALL_CORPUS_QUESTIONS, random_request, write_corpus

TEXTS = list(SMALL_CORPUS.values()) + list(SMALL_CORPUS_QUESTIONS.values())


def corpus_tokenizer():
    """A byte-level BPE trained on the small corpus (what the stand-in checkpoints carry)."""
    return train_tiny_tokenizer(TEXTS * 4)


def check_entry_shapes(engine: Engine, layer: int, transition: tuple[int, ...], state: tuple[int, ...],
                       conv_tail: tuple[int, ...]) -> None:
    """A 30-token entry's tensors of recurrent layer `layer`: transition P, suffix state Z, conv tail."""
    entry = engine.encode_segment(list(range(30)), 4)
    assert tuple(entry[tensor_name(layer, "transition")].shape) == transition
    assert tuple(entry[tensor_name(layer, "suffix_state")].shape) == state
    assert tuple(entry[tensor_name(layer, "conv_tail")].shape) == conv_tail


def check_mamba2_entry_shapes(engine: Engine, layer: int, *, heads: int, state: int, head_dim: int, groups: int,
                              conv_kernel: int) -> None:
    """`check_entry_shapes` of a Mamba2 (SSD) layer: a scalar transition per head [heads, 1, 1], the state
    [heads, state, head_dim], the conv tail over x, B and C [heads * head_dim + 2 * groups * state, conv_kernel - 1]."""
    check_entry_shapes(engine, layer, transition=(heads, 1, 1), state=(heads, state, head_dim),
                       conv_tail=(heads * head_dim + 2 * groups * state, conv_kernel - 1))


def served_from_a_segment_cache(engine: Engine, directory: Path, cache_format: str
                                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`hypic` logits [vocab] of a random request (seed 7; chunks of 19, 26 and 11 tokens, seam 4): from `engine`
    alone, and through an LMDB segment cache at `directory` in `cache_format`, first on a miss (entries encoded
    and stored), then on a hit (none encoded): (expected, {"encode": logits, "hit": logits})."""
    from hypic_rag.cache.keys import CacheNamespace
    from hypic_rag.cache.segment_cache import SegmentCache

    request = random_request(torch.Generator().manual_seed(7), [19, 26, 11])
    expected = engine.prefill(request, "hypic").logits
    namespace = CacheNamespace.for_model(engine.model, 4, cache_format=cache_format)
    served = {}
    for attempt in ("encode", "hit"):
        cache = SegmentCache.open(directory, namespace=namespace)
        try:
            result = Engine(engine.model, seam_tokens=4, segment_source=cache).prefill(request, "hypic")
        finally:
            cache.close()
        assert (result.stats.cache_misses == 0) == (attempt == "hit")
        served[attempt] = result.logits
    return expected, served


def published_layout(directory: Path) -> tuple[dict, set[str]]:
    """A sharded stand-in's config.json and the tensor names its safetensors index maps."""
    config = json.loads((directory / "config.json").read_text())
    return config, set(json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"])


def check_published_checkpoint_loads(directory: Path, instance) -> Engine:
    """`load_model` on a stand-in directory: its tokenizer loads, `full` equals the instance the directory holds
    (1e-4) and `hypic` decodes. Returns an engine over the loaded model."""
    model = load_model(directory, device="cpu")
    assert model.tokenizer is not None
    tokenizer = model.tokenizer
    request = Request(tokenizer.encode("Alice Marlow is"), [tokenizer.encode(text) for text in TEXTS[:3]],
                      tokenizer.encode(SMALL_CORPUS_QUESTIONS["glassblowing.md"]))
    ids = torch.tensor([request.all_ids()])
    with torch.no_grad():
        expected = instance(ids, use_cache=False).logits[0, -1]
    engine = Engine(model, seam_tokens=4)
    torch.testing.assert_close(engine.prefill(request, "full").logits, expected, atol=1e-4, rtol=1e-4)
    generation = engine.generate(request, "hypic", SamplingParams(max_new_tokens=4))
    assert len(generation.token_ids) == 4 or generation.finish_reason == "stop"
    return engine


def check_precompute_and_ask(model_directory: Path, work: Path) -> str:
    """`precompute` a small corpus with the checkpoint, then `ask` it (the CLI's `main` in this process; the real
    `python -m hypic_rag` processes on a published stand-in run once, in tests/e2e/test_families_end_to_end.py):
    both exit 0, the answer cites a document and every chunk entry was precomputed (0 encoded at question time).
    Returns ask's output."""
    corpus = write_corpus(work / "corpus", SMALL_CORPUS)
    built = run_cli_here("precompute", str(corpus), "--index", str(work / "index"), "--model",
                         str(model_directory), "--chunk-tokens", "48", "--no-progress", "--device", "cpu", cwd=work)
    assert built.returncode == 0, built.stderr
    asked = run_cli_here("ask", "--index", str(work / "index"), "--device", "cpu", "--max-new-tokens", "4",
                         SMALL_CORPUS_QUESTIONS["volcano.md"], cwd=work)
    assert asked.returncode == 0, asked.stderr
    assert ".md" in asked.stdout and ", 0 encoded" in asked.stdout, asked.stdout
    return asked.stdout
