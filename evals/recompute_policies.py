"""Recompute policies on a model never trained for composition: quality against recomputed tokens, over worlds.

The test bed (issues 20 and 29): the bundled model's stage-3 checkpoint (`evals/stage3_model/`, trained only on fully
attended contexts), held-out questions with the real retriever's top k = 8 chunks (`training/heldout_retrieval.py`,
as `evals/eval_default_model.py`), and for every variant: exact match, agreement of the greedy answer with `full`'s,
mean KL(full || variant) of the first answer token's distribution, the tokens it recomputes per request (seams,
whole chunks, the question, and a probe pass's tokens), the passes it runs and the bytes it stores per chunk beyond
a plain entry. JSON (`--out`), markdown tables (`--markdown`) and a plot (`--plot`).

Test beds (`--test-bed`): `default`, the held-out worlds above (every document one chunk); `cross-chunk` (issue 42,
`training/data/cross_chunk_qa.py`): two-chunk documents cut by the project's chunker at 48 tokens, the second chunk
never naming its subject, half the questions needing both chunks. Its reports add the retrieval recall of the needed
chunks and EM per question subset (`QUESTION_SUBSETS`: cross-chunk, single-chunk, needed chunks all retrieved).

    OMP_WAIT_POLICY=PASSIVE python -m evals.recompute_policies --test-bed cross-chunk --model evals/cross_chunk_model \\
        --worlds 911000000 --questions 200 --variants full,seam@8,seam@0+anchored

Worlds: `--worlds S1,S2,...` evaluates `--questions` questions of each world seed S (the held-out benchmark's
layout: 50 questions per generated world, worlds S, S+1, ...), reports each world with paired 95% intervals of
EM - full, and their mean (`summarize_worlds`). Worlds used to develop or calibrate a policy must not be the worlds
of the table that judges it (docs/recompute_policies.md names which were which).

A variant is `POLICY` or `POLICY|RANKING`:
- POLICY: a runtime policy spec (`hypic_rag.runtime.recompute_policy`: `seam@8`, `whole:1`, `budget:2`,
  `seam@0+anchored`, ...), a mode (`full`, `transition_rope`, `transition`, `addition`), a rule decided by the
  model's own signals (`evals/policy_signals.py`: `attention:N@W`, `deviation:N@W`), or a study-only rule of this
  file that needs more than the runtime's plans: `ends:E@W` (seam W at each chunk's start and its last E tokens
  recomputed, from an extra entry of the chunk without its last E tokens) and `wide:N:V@W` (the N top-ranked chunks
  at seam V, the rest at seam W: an extra entry per chunk at seam V).
- RANKING (which chunks matter most, for `whole` / `budget` / `wide`): `prompt` (retrieval order: direct hits
  best first, then the hop's), `alternate` (direct and hop hits alternately, as the pipeline ranks them),
  `score` (similarity to the question), `nearest` (closest to the question first), `oracle` (the gold
  documents first: an upper bound no product can use).

    OMP_WAIT_POLICY=PASSIVE python -m evals.recompute_policies --worlds 930000000,935000000 --questions 200 \\
        --out docs/benchmarks/recompute_policies_dev.json --markdown docs/benchmarks/recompute_policies_dev.md \\
        --plot docs/benchmarks/recompute_policies_dev.png
"""


from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from training.data.cross_chunk_qa import CROSS_CHUNK_HELDOUT_SEED
from training.data.synthetic_qa import HELDOUT_SEED
from training.evaluate import EvalItem, summarize

STAGE3_MODEL = Path(__file__).resolve().parent / "stage3_model"
CALIBRATION_SEED = 950_000_000
"""Worlds of the calibration questions: apart from training (< 40,000,000), validation (500,000,000+) and the
held-out set (900,000,000+, 50 questions per world: 200 questions use 4 worlds)."""
CROSS_CHUNK_CALIBRATION_SEED = 955_000_000
"""Cross-chunk worlds of the calibration questions (`--test-bed cross-chunk`)."""
TEST_BEDS = ("default", "cross-chunk")
"""`default`: the held-out worlds of one-chunk documents (`training/data/synthetic_qa.py`); `cross-chunk`: two-chunk
documents whose second chunk never names its subject (`training/data/cross_chunk_qa.py`, issue 42)."""
QUESTION_SUBSETS = ("cross", "single", "needed_retrieved", "cross_needed_retrieved")
"""Subsets of the cross-chunk test bed's questions reported apart: cross-chunk and single-chunk questions, those
whose needed chunks were all retrieved, and the cross-chunk ones among them."""
RANKINGS = ("prompt", "alternate", "score", "nearest", "oracle")
DEFAULT_VARIANTS = (
    "full,transition_rope,addition,seam@0,seam@2,seam@4,seam@8,seam@16,seam@32,"
    "whole:1|prompt,whole:1|alternate,whole:1|score,whole:1|nearest,whole:1|oracle,"
    "whole:2|prompt,whole:2|alternate,whole:2|score,whole:2|nearest,whole:2|oracle,"
    "whole:3|alternate,whole:4|alternate,budget:1.5|alternate,budget:2|alternate,budget:3|alternate,"
    "wide:2:16@8|alternate,wide:2:32@8|alternate,ends:8@8,ends:16@8"
)
WORLD_VARIANTS = (
    "full,seam@8,seam@0,whole:1|alternate,whole:2@0|alternate,budget:2|alternate,budget:3|alternate,"
    "attention:2@0,deviation:2@0,seam@0+anchored,seam@8+anchored,budget:2+anchored|alternate"
)
"""The multi-world table's variants (issue 29): the fixed seam, the rank-based policies, the model-signal rules and
the anchored entries."""
MODES = ("full", "transition_rope", "transition", "addition")


# ============================================================================================== rankings
def chunk_ranks(ranking: str, case: Any) -> list[int]:
    """Rank of each chunk of `case` (0 = most important) under `ranking` (one of `RANKINGS`)."""
    count = len(case.chunk_token_ids)
    if ranking == "prompt":
        order = list(range(count))
    elif ranking == "alternate":
        from hypic_rag.pipeline.answering import retrieval_ranks

        return retrieval_ranks(case.from_hop)
    elif ranking == "score":
        order = sorted(range(count), key=lambda n: -case.scores[n])
    elif ranking == "nearest":
        order = list(reversed(range(count)))
    elif ranking == "oracle":
        gold = list(case.question.gold_doc_ids)
        order = sorted(range(count), key=lambda n: (gold.index(case.retrieved_doc_ids[n])
                                                     if case.retrieved_doc_ids[n] in gold else len(gold), n))
    else:
        raise ValueError(f"unknown ranking {ranking!r}; choose one of {', '.join(RANKINGS)}")
    ranks = [0] * count
    for rank, number in enumerate(order):
        ranks[number] = rank
    return ranks


# ============================================================================================== variants
@dataclass(frozen=True, slots=True)
class WideSeams:
    """Study rule `wide:N:V@W`: the N top-ranked chunks at seam V, the others at seam W (an extra entry per chunk
    at seam V: the cache holds two entries per chunk)."""

    chunks: int
    wide_seam: int
    seam: int

    def plan(self, chunk_lengths: Sequence[int], default_seam: int, ranks: Sequence[int] = ()):
        from hypic_rag.runtime.recompute_policy import RecomputePlan

        order = sorted(range(len(chunk_lengths)), key=lambda n: (ranks[n] if ranks else 0, n))
        seams = [self.seam] * len(chunk_lengths)
        for number in order[: self.chunks]:
            seams[number] = self.wide_seam
        return RecomputePlan(tuple(seams))


@dataclass(slots=True)
class Variant:
    """One row of the study: a label, how to prefill a request, and what it costs beyond a plain entry and pass:
    extra entries per chunk, extra passes per request (a probe), and what it stores per chunk besides
    (`extra_bytes_note`; anchored entries' bytes are measured per request, see `run_variant`)."""

    label: str
    kind: str  # "mode", "policy", "ends", "attention", "deviation"
    spec: str
    ranking: str | None = None
    policy: Any = None
    end_tokens: int = 0
    seam: int = 8
    extra_entries_per_chunk: int = 0
    notes: str = ""
    chunks: int = 0
    extra_passes: int = 0
    extra_bytes_per_chunk: int = 0


def parse_variant(text: str, default_seam: int) -> Variant:
    """A `Variant` from `POLICY[|RANKING]` (see the module docstring)."""
    from hypic_rag.runtime.recompute_policy import RecomputePolicy

    spec, _, ranking = text.strip().partition("|")
    ranking = ranking or None
    if ranking is not None and ranking not in RANKINGS:
        raise ValueError(f"unknown ranking {ranking!r} in {text!r}")
    if spec in MODES:
        return Variant(spec, "mode", spec)
    from evals.policy_signals import SIGNAL_RULE

    signal = SIGNAL_RULE.fullmatch(spec)
    if signal:
        kind, chunks, seam = signal.group("signal"), int(signal.group("chunks")), int(signal.group("seam"))
        if kind == "attention":
            return Variant(spec, kind, spec, seam=seam, chunks=chunks, extra_passes=1,
                           notes="model signal: question attention in a probe pass (+1 pass)")
        return Variant(spec, kind, spec, seam=seam, chunks=chunks, extra_bytes_per_chunk=4,
                       notes="model signal: K/V deviation stored at encoding (+4 B/chunk, +1 encoding)")
    ends = re.fullmatch(r"ends:(\d+)@(\d+)", spec)
    if ends:
        return Variant(spec, "ends", spec, end_tokens=int(ends.group(1)), seam=int(ends.group(2)),
                       extra_entries_per_chunk=1, notes="study only: an extra entry per chunk")
    wide = re.fullmatch(r"wide:(\d+):(\d+)@(\d+)", spec)
    if wide:
        rule = WideSeams(int(wide.group(1)), int(wide.group(2)), int(wide.group(3)))
        return Variant(text, "policy", spec, ranking or "prompt", rule, seam=rule.seam, extra_entries_per_chunk=1,
                       notes="study only: an extra entry per chunk")
    policy = RecomputePolicy.parse(spec)
    if policy.kind == "seam":
        return Variant(spec, "policy", spec, None, policy, seam=policy.chunk_seam(default_seam))
    ranking = ranking or "prompt"
    return Variant(f"{spec}|{ranking}", "policy", spec, ranking, policy, seam=policy.chunk_seam(default_seam))


# ============================================================================================== running
def prefill_ends(engine: Any, request: Any, seam: int, end_tokens: int):
    """Seam `seam` at each chunk's start and its last `end_tokens` recomputed: each chunk is two spans, the chunk
    without its last tokens from that shorter segment's own seam-`seam` entry (its K/V are the chunk's first
    tokens', causal; its suffix pair ends where the recomputed end begins), then the end recomputed. Returns the
    stack's result (logits, state, recomputed tokens)."""
    from hypic_rag.runtime.engine import PrefillStats
    from hypic_rag.runtime.stack import Span, run_stack

    stats = PrefillStats(mode="hypic")
    spans, position = [], 0
    if request.prefix_ids:
        entry = engine.fetch_entries([request.prefix_ids], 0, stats)[0]
        spans.append(Span(list(request.prefix_ids), 0, 0, entry))
        position = len(request.prefix_ids)
    heads = [chunk[: max(0, len(chunk) - end_tokens)] for chunk in request.chunk_ids]
    entries = engine.fetch_entries([head for head in heads if len(head) > seam], seam, stats)
    found = iter(entries)
    for chunk, head in zip(request.chunk_ids, heads):
        if len(head) > seam:
            spans.append(Span(list(head), position, seam, next(found)))
            spans.append(Span(list(chunk[len(head):]), position + len(head), len(chunk) - len(head)))
        else:
            spans.append(Span(list(chunk), position, len(chunk)))
        position += len(chunk)
    spans.append(Span(list(request.question_ids), position, len(request.question_ids)))
    return run_stack(engine.model, spans)


def greedy_decode(engine: Any, logits: torch.Tensor, state: Any, stop: str, max_new_tokens: int = 24) -> str:
    """Greedy continuation from a prefill's logits and state up to `stop` (what `Engine.generate` does greedily)."""
    tokenizer = engine.model.tokenizer
    generated: list[int] = []
    for step in range(max_new_tokens):
        token = int(torch.argmax(logits))
        if token in engine.model.eos_token_ids:
            break
        generated.append(token)
        text = tokenizer.decode(generated, skip_special_tokens=True)
        if stop in text:
            return text.split(stop)[0].strip()
        if step + 1 < max_new_tokens:
            logits, state = engine.decode_step(state, token)
    return tokenizer.decode(generated, skip_special_tokens=True).split(stop)[0].strip()


_DEVIATIONS: dict[int, Any] = {}
"""Per engine (by id), the `policy_signals.DeviationIndex` of its chunks (a statistic kept per chunk)."""


def run_variant(engine: Any, variant: Variant, request: Any) -> tuple[torch.Tensor, Any, int]:
    """(first-token logits [vocab], decode state, tokens recomputed) of `request` under `variant`."""
    if variant.kind == "mode":
        result = engine.prefill(request, variant.spec)
        return result.logits, result.state, result.stats.recomputed_tokens
    if variant.kind == "ends":
        result = prefill_ends(engine, request, variant.seam, variant.end_tokens)
        return result.logits, result.state, result.recomputed_tokens
    if variant.kind == "attention":
        from evals.policy_signals import prefill_by_attention

        return prefill_by_attention(engine, request, variant.chunks, variant.seam)[:3]
    if variant.kind == "deviation":
        from evals.policy_signals import DeviationIndex, prefill_by_deviation

        deviations = _DEVIATIONS.setdefault(id(engine), DeviationIndex(engine))
        return prefill_by_deviation(engine, deviations, request, variant.chunks, variant.seam)[:3]
    result = engine.prefill(request, "hypic", policy=variant.policy)
    return result.logits, result.state, result.stats.recomputed_tokens


def entry_bytes_per_token(engine: Any) -> int:
    """Bytes one more token adds to an entry of `engine`'s model: its K/V rows in every attention layer and its
    token id (a recurrent layer's state is the same size whatever the segment's length). Measured once per engine
    from the sizes of two encoded entries."""
    from hypic_rag.entry.schema import entry_tensor_bytes

    cached = _BYTES_PER_TOKEN.get(id(engine))
    if cached is None:
        short, longer = engine.encode_segments([[5, 6, 7, 8], [5, 6, 7, 8, 9]], 0)
        cached = _BYTES_PER_TOKEN[id(engine)] = entry_tensor_bytes(longer) - entry_tensor_bytes(short)
    return cached


_BYTES_PER_TOKEN: dict[int, int] = {}


def anchored_bytes_per_chunk(engine: Any, request: Any, seam: int, policy: Any = None) -> float:
    """Mean bytes the entry a chunk of `request` reads under an anchored or chained `policy` (None: anchored at
    `seam`) holds beyond the chunk's plain entry, over the request's chunks: the rows of the tokens it was encoded
    after (`entry_bytes_per_token` each), the anchor's, and for a chained entry the antecedent chunk's too. A chained
    policy's index also keeps the anchored entry of every chunk it keeps a chained one for (serving the chunk when it
    is retrieved without its antecedent): that entry is not read here, and not counted."""
    from hypic_rag.runtime.recompute_policy import SeamPolicy

    policy = policy if policy is not None else SeamPolicy(seam_tokens=seam, anchored=True)
    plain = SeamPolicy(seam_tokens=seam, anchored=policy.anchored, chained=policy.chained)
    keys = engine.segment_entry_keys(request, "hypic", policy=plain)[1 if request.prefix_ids else 0:]
    per_token = entry_bytes_per_token(engine)
    extra = [per_token * (entry_seam - seam) for entry_seam, _ in keys]
    return sum(extra) / max(1, len(extra))


INDEX_KINDS = {"plain": "seam", "anchored": "seam+anchored", "chained": "seam+chained"}
"""The kinds of precomputed index a policy needs, each with the policy whose entries `precompute` encodes for it: a
plain index (every chunk's entry), an anchored one (every chunk's anchored entry) and a chained one (the anchored
entries and the chained entry of every chunk that follows its document's previous chunk)."""


def index_kind(policy: Any) -> str | None:
    """The `INDEX_KINDS` kind a variant's runtime policy reads from (None: a mode or a study rule)."""
    if not hasattr(policy, "anchored"):
        return None
    return "chained" if policy.chained else ("anchored" if policy.anchored else "plain")


def stored_entries(cache_dir: Path) -> dict[bytes, int]:
    """Every entry a segment cache directory's LMDB store holds: key -> bytes of its stored value (each value read,
    not its bookkeeping record)."""
    from hypic_rag.cache.lmdb_store import LmdbSegmentStore

    store = LmdbSegmentStore.open(cache_dir, readonly=True)
    try:
        keys = list(store.keys())
        return {bytes(key): len(value) for key, value in zip(keys, store.batched_get(keys, touch=False))
                if value is not None}
    finally:
        store.close()


def index_bytes(model_path: Path, documents_dir: Path, work_dir: Path, *, chunk_tokens: int, seam_tokens: int = 8,
                kinds: dict[str, str] = INDEX_KINDS) -> dict[str, Any]:
    """What a precomputed index of `documents_dir` stores per chunk for each index kind (`kinds`: kind -> the policy
    whose entries are encoded): each built by `precompute` (`build_index(..., recompute_policy=...)`) in `work_dir`,
    its entries then counted in its LMDB store (`stored_entries`; the prompt prefix's entry included). Per kind:
    chunks, entries, stored bytes, bytes per chunk, the ratio to the plain index's, the encoding seconds and
    tokens; for the chained index also the entries and bytes beyond the anchored index's (its chained entries)."""
    from hypic_rag.pipeline.precompute import build_index

    rows: dict[str, dict[str, Any]] = {}
    held: dict[str, dict[bytes, int]] = {}
    for kind, policy in kinds.items():
        summary = build_index(documents_dir, work_dir / f"index-{kind}", model=model_path, chunk_tokens=chunk_tokens,
                              seam_tokens=seam_tokens, recompute_policy=policy, device="cpu", show_progress=False)
        held[kind] = stored_entries(Path(summary.cache_dir))
        stored = sum(held[kind].values())
        rows[kind] = {"policy": policy, "documents": summary.documents, "chunks": summary.chunks,
                      "entries": len(held[kind]), "stored_bytes": stored, "bytes_per_chunk": stored / summary.chunks,
                      "planned_bytes": summary.cache_bytes, "encode_seconds": summary.encode.seconds,
                      "encoded_tokens": summary.encode.tokens_encoded}
    for row in rows.values():
        row["x_plain"] = row["stored_bytes"] / rows["plain"]["stored_bytes"] if "plain" in rows else float("nan")
    if "chained" in held and "anchored" in held:
        beyond = {key: size for key, size in held["chained"].items() if key not in held["anchored"]}
        rows["chained"]["chained_entries"] = len(beyond)
        rows["chained"]["chained_bytes"] = sum(beyond.values())
        rows["chained"]["x_anchored"] = rows["chained"]["stored_bytes"] / rows["anchored"]["stored_bytes"]
    return {"chunk_tokens": chunk_tokens, "seam_tokens": seam_tokens, "kinds": rows}


def cross_chunk_index_bytes(model_path: Path, seed: int, seam_tokens: int = 8) -> dict[str, Any]:
    """`index_bytes` of cross-chunk world `seed`'s documents at the test bed's chunk size, checked to be cut into the
    test bed's chunks (`cross_chunk_chunker`)."""
    import tempfile

    from hypic_rag.retrieval.corpus_index import DOCSTORE_FILE
    from training.data.cross_chunk_qa import CROSS_CHUNK_TOKENS, generate_cross_chunk_world, write_cross_chunk_corpus

    with tempfile.TemporaryDirectory() as scratch:
        documents_dir = write_cross_chunk_corpus(generate_cross_chunk_world(seed), [], Path(scratch) / "world")
        result = index_bytes(model_path, documents_dir, Path(scratch), chunk_tokens=CROSS_CHUNK_TOKENS,
                             seam_tokens=seam_tokens)
        result["seed"] = seed
        result["chunks_per_document"] = _chunks_per_document(Path(scratch) / "index-plain" / DOCSTORE_FILE)
    return result


def _chunks_per_document(path: Path) -> dict[int, int]:
    """How many documents of the docstore at `path` have 1, 2, ... chunks."""
    from collections import Counter

    from hypic_rag.retrieval.docstore import DocStore

    docstore = DocStore(path)
    try:
        per_document = Counter(chunk.doc_id for chunk in docstore.iter_chunks())
    finally:
        docstore.close()
    return dict(sorted(Counter(per_document.values()).items()))


def index_bytes_markdown(measured: dict[str, Any]) -> str:
    """The index bytes per chunk of each index kind (`index_bytes`)."""
    kinds = measured["kinds"]
    lines = [f"Index bytes per chunk (`precompute` of world {measured.get('seed', '?')}'s documents at "
             f"{measured['chunk_tokens']}-token chunks, seam {measured['seam_tokens']}; counted from the entries in "
             "the index's LMDB store, the prompt prefix's entry included):", "",
             "| index | policy it is built for | chunks | entries | bytes / chunk | x plain | encoding (s) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for kind, row in kinds.items():
        lines.append(f"| {kind} | `{row['policy']}` | {row['chunks']} | {row['entries']} | "
                     f"{row['bytes_per_chunk'] / 1024:.1f} KiB | {row['x_plain']:.2f} | {row['encode_seconds']:.1f} |")
    chained = kinds.get("chained", {})
    if "chained_entries" in chained:
        lines += ["", f"The chained index holds the anchored index's entries and {chained['chained_entries']} chained "
                      f"ones ({chained['chained_bytes'] / max(1, chained['chained_entries']) / 1024:.1f} KiB each): "
                      f"{chained['x_anchored']:.2f}x the anchored index's bytes."]
    return "\n".join(lines) + "\n"


@dataclass(slots=True)
class Tally:
    """What one variant accumulates over the cases."""

    answers: list[str] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    recomputed: list[int] = field(default_factory=list)
    extra_bytes: list[float] = field(default_factory=list)
    seconds: float = 0.0


def build_requests(cases: Sequence[Any], encoder: Any) -> list[Any]:
    """The requests of `cases`: prefix, retrieved chunks in prompt order, question; a chunk that follows its
    document's previous chunk is marked (`Request.chunk_follows`, what chained policies read)."""
    from hypic_rag.pipeline.answering import follows_of
    from hypic_rag.runtime.request import Request

    requests = []
    for case in cases:
        positions = getattr(case, "chunk_positions", None)
        follows = follows_of(list(zip(case.retrieved_doc_ids, positions)),
                             [(doc_id, position - 1) for doc_id, position in zip(case.retrieved_doc_ids, positions)],
                             ) if positions else []
        requests.append(Request(list(encoder.prefix()), case.chunk_token_ids, encoder.question(case.question.text),
                                chunk_follows=follows if any(follows) else []))
    return requests


def evaluate(engine: Any, cases: Sequence[Any], variants: Sequence[Variant], stop: str,
             progress: bool = True) -> dict[str, Any]:
    """Every variant on every case against `full`: the report's rows (see `row_of`)."""
    import dataclasses

    from hypic_rag.runtime.quality import kl_divergence
    from training.packing import SegmentEncoder

    encoder = SegmentEncoder(engine.model.tokenizer)
    requests = build_requests(cases, encoder)
    reference = Variant("full", "mode", "full")
    tallies: dict[str, Tally] = {variant.label: Tally() for variant in variants}
    full_answers: list[str] = []
    for case, request in tqdm(list(zip(cases, requests)), desc="questions", file=sys.stderr, disable=not progress):
        full_logits, full_state, _ = run_variant(engine, reference, request)
        full_answers.append(greedy_decode(engine, full_logits, full_state, stop))
        for variant in variants:
            ranked = request if variant.ranking is None else dataclasses.replace(
                request, chunk_ranks=chunk_ranks(variant.ranking, case))
            began = time.perf_counter()
            logits, state, recomputed = run_variant(engine, variant, ranked)
            tally = tallies[variant.label]
            tally.answers.append(greedy_decode(engine, logits, state, stop))
            tally.seconds += time.perf_counter() - began
            tally.kl.append(kl_divergence(full_logits, logits))
            tally.recomputed.append(recomputed)
            policy = variant.policy
            tally.extra_bytes.append(anchored_bytes_per_chunk(engine, request, variant.seam, policy)
                                     if getattr(policy, "anchored", False) else variant.extra_bytes_per_chunk)
    prompt_tokens = sum(request.prompt_tokens for request in requests) / len(requests)
    question_tokens = sum(len(request.question_ids) for request in requests) / len(requests)
    rows = {variant.label: row_of(variant, tallies[variant.label], cases, full_answers) for variant in variants}
    return {"prompt_tokens": prompt_tokens, "question_tokens": question_tokens, "rows": rows,
            "full_answers": full_answers}


def paired_difference(flags: Sequence[bool], reference: Sequence[bool]) -> dict[str, Any]:
    """EM(variant) - EM(reference) on the same questions with its 95% interval (normal approximation of the paired
    differences) and the discordant counts (variant right / reference wrong, and the reverse)."""
    count = len(flags)
    differences = [int(a) - int(b) for a, b in zip(flags, reference)]
    mean = sum(differences) / count
    variance = sum((d - mean) ** 2 for d in differences) / max(1, count - 1)
    half = 1.959963984540054 * (variance / count) ** 0.5
    return {"em_minus_full": mean, "em_minus_full_ci95": [mean - half, mean + half],
            "only_variant_right": differences.count(1), "only_full_right": differences.count(-1)}


def in_subset(case: Any, subset: str) -> bool:
    """Whether a cross-chunk case belongs to `subset` (one of `QUESTION_SUBSETS`)."""
    kind = getattr(case.question, "kind", "single")
    if subset in ("cross", "single"):
        return kind == subset
    if subset == "needed_retrieved":
        return case.needed_retrieved
    return kind == "cross" and case.needed_retrieved


def subset_rows(cases: Sequence[Any], exact: Sequence[bool], full_exact: Sequence[bool]) -> dict[str, Any]:
    """Per `QUESTION_SUBSETS` subset (cross-chunk cases only; empty otherwise): questions, EM, EM - full."""
    if not cases or not hasattr(cases[0].question, "needed_chunks"):
        return {}
    subsets = {}
    for subset in QUESTION_SUBSETS:
        chosen = [number for number, case in enumerate(cases) if in_subset(case, subset)]
        if chosen:
            em = sum(exact[n] for n in chosen) / len(chosen)
            subsets[subset] = {"questions": len(chosen), "exact_match": em,
                               "em_minus_full": em - sum(full_exact[n] for n in chosen) / len(chosen)}
    return subsets


def needed_recall(cases: Sequence[Any]) -> dict[str, float]:
    """Retrieval recall of the chunks each question needs: the share of questions whose needed chunks were all
    retrieved, over all questions and per question kind (cross-chunk cases; the gold documents' otherwise)."""
    recall = {"all": sum(case.needed_retrieved for case in cases) / len(cases)}
    for kind in ("cross", "single"):
        chosen = [case for case in cases if getattr(case.question, "kind", "single") == kind]
        if chosen:
            recall[kind] = sum(case.needed_retrieved for case in chosen) / len(chosen)
    return recall


def row_of(variant: Variant, tally: Tally, cases: Sequence[Any], full_answers: Sequence[str]) -> dict[str, Any]:
    items = [EvalItem(case.question, answer) for case, answer in zip(cases, tally.answers)]
    summary = summarize(items)
    full_exact = [EvalItem(case.question, answer).exact for case, answer in zip(cases, full_answers)]
    count = len(cases)
    return {
        "variant": variant.label,
        "spec": variant.spec,
        "ranking": variant.ranking,
        "kind": variant.kind,
        "notes": variant.notes,
        "extra_entries_per_chunk": variant.extra_entries_per_chunk,
        "extra_passes": variant.extra_passes,
        "extra_bytes_per_chunk": sum(tally.extra_bytes) / count if tally.extra_bytes else 0.0,
        **summary,
        "agreement": sum(a == b for a, b in zip(tally.answers, full_answers)) / count,
        "kl": sum(tally.kl) / count,
        "kl_median": float(torch.tensor(tally.kl).median()),
        "recomputed_tokens": sum(tally.recomputed) / count,
        "seconds": round(tally.seconds, 2),
        **paired_difference([item.exact for item in items], full_exact),
        "exact_flags": "".join("1" if item.exact else "0" for item in items),
        "subsets": subset_rows(cases, [item.exact for item in items], full_exact),
    }


# ============================================================================================== report
def pareto_flags(rows: Sequence[dict[str, Any]], quality: str = "exact_match") -> list[bool]:
    """Whether each row is on the Pareto front of (fewer recomputed tokens, higher `quality`): no other row has
    at most its tokens and strictly better quality, or equal quality with strictly fewer tokens."""
    flags = []
    for row in rows:
        dominated = any(
            other is not row and other["recomputed_tokens"] <= row["recomputed_tokens"]
            and (other[quality] > row[quality] or (other[quality] == row[quality]
                                                   and other["recomputed_tokens"] < row["recomputed_tokens"]))
            for other in rows
        )
        flags.append(not dominated)
    return flags


def markdown_table(report: dict[str, Any], reference: str = "seam@8") -> str:
    """The Pareto table: one line per variant by recomputed tokens; EM, its gap to `full`, agreement, KL,
    tokens and their ratio to `reference`'s, and the Pareto front (on EM and on KL)."""
    rows = sorted(report["rows"].values(), key=lambda row: (row["recomputed_tokens"], -row["exact_match"]))
    full = report["rows"]["full"]["exact_match"] if "full" in report["rows"] else float("nan")
    base = report["rows"].get(reference, {}).get("recomputed_tokens", float("nan"))
    front_em = pareto_flags(rows)
    kl_rows = [{**row, "neg_kl": -row["kl"]} for row in rows]
    front_kl = pareto_flags(kl_rows, "neg_kl")
    lines = [
        f"{report['questions']} held-out questions (seed {report['seed']}), k = {report['k']}, model "
        f"`{report['model_label']}`; prompt {report['prompt_tokens']:.0f} tokens on average (question "
        f"{report['question_tokens']:.0f}). Recomputed tokens per request count seams, whole chunks and the question.",
        "",
        f"| variant | recomputed tokens / request | x {reference} | EM | EM - full (points) [95% paired] | agreement with full "
        "| KL(full ‖ variant), mean | median | Pareto (EM) | Pareto (KL) | notes |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row, on_em, on_kl in zip(rows, front_em, front_kl):
        lines.append(
            f"| {row['variant']} | {row['recomputed_tokens']:.1f} | {row['recomputed_tokens'] / base:.2f} | "
            f"{100 * row['exact_match']:.1f}% | {100 * (row['exact_match'] - full):+.1f}{_interval(row)} | "
            f"{100 * row['agreement']:.1f}% | {row['kl']:.4f} | {row['kl_median']:.4f} | {'yes' if on_em else ''} | "
            f"{'yes' if on_kl else ''} | {row['notes']} |"
        )
    if rows and rows[0].get("subsets"):
        lines += ["", subsets_markdown(rows, report.get("needed_recall"))]
    return "\n".join(lines) + "\n"


def subsets_markdown(rows: Sequence[dict[str, Any]], recall: dict[str, float] | None = None) -> str:
    """EM (and EM - full, points) per question subset of the cross-chunk test bed, one line per variant."""
    present = [subset for subset in QUESTION_SUBSETS if subset in rows[0]["subsets"]]
    counts = ", ".join(f"{subset} {rows[0]['subsets'][subset]['questions']}" for subset in present)
    lines = [f"By question ({counts} questions)"
             + ("; retrieval recall of the needed chunks: " + ", ".join(f"{name} {100 * value:.1f}%"
                                                                     for name, value in recall.items())
                if recall else "") + ":", "",
             "| variant | " + " | ".join(f"EM {subset} (- full)" for subset in present) + " |",
             "| --- |" + " --- |" * len(present)]
    for row in rows:
        cells = [f"{100 * row['subsets'][subset]['exact_match']:.1f}% ({100 * row['subsets'][subset]['em_minus_full']:+.1f})"
                 for subset in present]
        lines.append(f"| {row['variant']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _interval(row: dict[str, Any]) -> str:
    """" [lo, hi]" in points when the row has a paired interval (results saved before it was added have none)."""
    interval = row.get("em_minus_full_ci95")
    return "" if interval is None else f" [{100 * interval[0]:+.1f}, {100 * interval[1]:+.1f}]"


def plot(report: dict[str, Any], path: Path) -> None:
    """EM and mean KL against recomputed tokens per request, one point per variant, labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(report["rows"].values())
    figure, (left, right) = plt.subplots(1, 2, figsize=(15, 6))
    colours = {"mode": "tab:gray", "seam": "tab:blue", "whole": "tab:green", "budget": "tab:orange",
               "wide": "tab:purple", "ends": "tab:red"}
    for row in rows:
        family = row["kind"] if row["kind"] != "policy" else row["spec"].split(":")[0].split("@")[0]
        colour = colours.get(family, "black")
        x = row["recomputed_tokens"]
        for axis, y in ((left, 100 * row["exact_match"]), (right, max(row["kl"], 1e-4))):
            axis.scatter([x], [y], color=colour, s=22)
            axis.annotate(row["variant"], (x, y), fontsize=6, xytext=(3, 2), textcoords="offset points")
    if "full" in report["rows"]:
        left.axhline(100 * report["rows"]["full"]["exact_match"], color="tab:gray", linestyle=":", linewidth=1)
        left.axhline(100 * report["rows"]["full"]["exact_match"] - 2, color="tab:red", linestyle=":", linewidth=1)
    if "seam@8" in report["rows"]:
        for axis in (left, right):
            axis.axvline(2 * report["rows"]["seam@8"]["recomputed_tokens"], color="tab:red", linestyle=":", linewidth=1)
    left.set_xscale("log")
    right.set_xscale("log")
    right.set_yscale("log")
    left.set_xlabel("recomputed tokens per request (log)")
    right.set_xlabel("recomputed tokens per request (log)")
    left.set_ylabel("exact match (%)")
    right.set_ylabel("mean KL(full || variant), first answer token (log)")
    left.set_title(f"{report['model_label']}: EM (dotted: full, full - 2 points, 2x seam@8 tokens)", fontsize=9)
    right.set_title(f"{report['model_label']}: KL, {report['questions']} held-out questions, k = {report['k']}",
                    fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# ============================================================================================== worlds
def summarize_worlds(worlds: Sequence[dict[str, Any]], reference: str = "seam@8") -> dict[str, dict[str, Any]]:
    """Per variant over the world reports: mean EM and EM - full, the worst and best world's EM - full, the paired
    95% interval of EM - full over all their questions, mean recomputed tokens (and their ratio to `reference`'s),
    mean KL and agreement, and the variant's costs."""
    summary: dict[str, dict[str, Any]] = {}
    labels = [label for label in worlds[0]["rows"] if all(label in world["rows"] for world in worlds)]
    base = sum(world["rows"][reference]["recomputed_tokens"] for world in worlds) / len(worlds) \
        if all(reference in world["rows"] for world in worlds) else float("nan")
    for label in labels:
        rows = [world["rows"][label] for world in worlds]
        fulls = [world["rows"]["full"] for world in worlds]
        gaps = [row["exact_match"] - full["exact_match"] for row, full in zip(rows, fulls)]
        flags = [flag == "1" for row in rows for flag in row["exact_flags"]]
        full_flags = [flag == "1" for full in fulls for flag in full["exact_flags"]]
        tokens = sum(row["recomputed_tokens"] for row in rows) / len(rows)
        summary[label] = {
            "variant": label, "kind": rows[0]["kind"], "spec": rows[0]["spec"], "notes": rows[0]["notes"],
            "worlds": len(rows), "questions": len(flags),
            "exact_match": sum(row["exact_match"] for row in rows) / len(rows),
            "em_minus_full_by_world": gaps,
            "em_minus_full_mean": sum(gaps) / len(gaps), "em_minus_full_worst": min(gaps),
            "em_minus_full_best": max(gaps),
            "em_minus_full_ci95_pooled": paired_difference(flags, full_flags)["em_minus_full_ci95"],
            "recomputed_tokens": tokens, "x_reference": tokens / base, "reference": reference,
            "kl": sum(row["kl"] for row in rows) / len(rows),
            "agreement": sum(row["agreement"] for row in rows) / len(rows),
            "extra_passes": rows[0].get("extra_passes", 0),
            "extra_bytes_per_chunk": sum(row.get("extra_bytes_per_chunk", 0.0) for row in rows) / len(rows),
            "extra_entries_per_chunk": rows[0].get("extra_entries_per_chunk", 0),
            "subsets": _mean_subsets([row.get("subsets", {}) for row in rows]),
        }
    return summary


def _mean_subsets(per_world: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The worlds' subset rows pooled: questions summed, EM and EM - full weighted by questions."""
    pooled: dict[str, Any] = {}
    for subset in QUESTION_SUBSETS:
        found = [subsets[subset] for subsets in per_world if subset in subsets]
        if found and len(found) == len(per_world):
            count = sum(item["questions"] for item in found)
            pooled[subset] = {"questions": count,
                              "exact_match": sum(item["exact_match"] * item["questions"] for item in found) / count,
                              "em_minus_full": sum(item["em_minus_full"] * item["questions"] for item in found) / count}
    return pooled


def _cost(row: dict[str, Any]) -> str:
    parts = []
    if row.get("extra_passes"):
        parts.append(f"+{row['extra_passes']} pass")
    if row.get("extra_bytes_per_chunk"):
        parts.append(f"+{row['extra_bytes_per_chunk'] / 1024:.1f} KiB/chunk" if row["extra_bytes_per_chunk"] >= 1024
                     else f"+{row['extra_bytes_per_chunk']:.0f} B/chunk")
    if row.get("extra_entries_per_chunk"):
        parts.append(f"+{row['extra_entries_per_chunk']} entry/chunk")
    return ", ".join(parts)


def worlds_markdown(report: dict[str, Any]) -> str:
    """The multi-world report: the mean table (one line per variant, by recomputed tokens), EM - full per world,
    then each world's own table."""
    worlds = report["worlds"]
    index = (report.get("index_bytes") or {}).get("kinds")
    summary = sorted(report["summary"].values(), key=lambda row: (row["recomputed_tokens"], -row["exact_match"]))
    seeds = [world["seed"] for world in worlds]
    lines = [
        f"{len(worlds)} worlds ({', '.join(str(seed) for seed in seeds)}), {report['questions']} held-out questions "
        f"each, k = {report['k']}, model `{report['model_label']}`. Recomputed tokens per request count seams, whole "
        "chunks, the question and any probe pass; cost = what a variant needs beyond a plain entry and one pass.",
        "",
        "**Mean over the worlds**",
        "",
        "| variant | recomputed tokens / request | x seam@8 | EM | EM - full: mean [pooled 95% paired] | worst world "
        "| agreement with full | KL(full ‖ variant) | cost |" + (" index bytes / chunk |" if index else ""),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |" + (" --- |" if index else ""),
    ]
    for row in summary:
        low, high = row["em_minus_full_ci95_pooled"]
        lines.append(
            f"| {row['variant']} | {row['recomputed_tokens']:.1f} | {row['x_reference']:.2f} | "
            f"{100 * row['exact_match']:.1f}% | {100 * row['em_minus_full_mean']:+.1f} [{100 * low:+.1f}, "
            f"{100 * high:+.1f}] | {100 * row['em_minus_full_worst']:+.1f} | {100 * row['agreement']:.1f}% | "
            f"{row['kl']:.4f} | {_cost(row)} |"
            + (f" {_index_cell(index, row, report['seam_tokens'])} |" if index else ""))
    lines += ["", "**EM - full (points) per world** (`full`'s EM in the header)", "",
              "| variant | " + " | ".join(f"{seed} ({100 * world['rows']['full']['exact_match']:.1f}%)"
                                        for seed, world in zip(seeds, worlds)) + " |",
              "| --- |" + " --- |" * len(worlds)]
    for row in summary:
        cells = []
        for world in worlds:
            item = world["rows"][row["variant"]]
            cells.append(f"{100 * (item['exact_match'] - world['rows']['full']['exact_match']):+.1f}"
                         f"{_interval(item)}")
        lines.append(f"| {row['variant']} | " + " | ".join(cells) + " |")
    if summary and summary[0].get("subsets"):
        recalls = [world.get("needed_recall") for world in worlds]
        pooled = {name: sum(recall[name] for recall in recalls) / len(recalls) for name in recalls[0]} \
            if all(recalls) else None
        lines += ["", "**By question, over the worlds**", "", subsets_markdown(summary, pooled)]
    for world in worlds:
        lines += ["", f"**World {world['seed']}**", "", markdown_table(world)]
    return "\n".join(lines) + "\n"


def _index_cell(index: dict[str, Any], row: dict[str, Any], seam_tokens: int) -> str:
    """The bytes per chunk of the index a summary row's policy reads from (`index_bytes`), and its ratio to a plain
    index's; empty for a mode or a study rule."""
    kind = index_kind(parse_variant(row["variant"], seam_tokens).policy)
    if kind is None or kind not in index:
        return ""
    return f"{index[kind]['bytes_per_chunk'] / 1024:.0f} KiB ({index[kind]['x_plain']:.2f}x, {kind})"


def plot_worlds(report: dict[str, Any], path: Path) -> None:
    """EM - full (mean over worlds; bars: worst to best world) and mean KL against recomputed tokens per request
    (probe passes included), one point per variant; markers say what a variant costs beyond its tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(report["summary"].values())
    figure, (left, right) = plt.subplots(1, 2, figsize=(15, 6.5))
    for row in rows:
        marker = "^" if row["extra_passes"] else ("s" if row["extra_bytes_per_chunk"] else "o")
        colour = "tab:red" if "anchored" in row["variant"] else ("tab:purple" if row["kind"] in (
            "attention", "deviation") else ("tab:gray" if row["kind"] == "mode" else "tab:blue"))
        x = row["recomputed_tokens"]
        mean = 100 * row["em_minus_full_mean"]
        left.errorbar([x], [mean], yerr=[[mean - 100 * row["em_minus_full_worst"]],
                                         [100 * row["em_minus_full_best"] - mean]],
                      fmt=marker, color=colour, markersize=6, capsize=2, linewidth=0.8)
        right.scatter([x], [max(row["kl"], 1e-4)], marker=marker, color=colour, s=30)
        label = row["variant"] + (f" ({_cost(row)})" if _cost(row) else "")
        for axis, y in ((left, mean), (right, max(row["kl"], 1e-4))):
            axis.annotate(label, (x, y), fontsize=6, xytext=(4, 2), textcoords="offset points")
    seam8 = report["summary"].get("seam@8")
    for axis in (left, right):
        axis.set_xscale("log")
        axis.set_xlabel("recomputed tokens per request, probe passes included (log)")
        if seam8 is not None:
            axis.axvline(2 * seam8["recomputed_tokens"], color="tab:red", linestyle=":", linewidth=1)
    for level, style in ((0, "-"), (-1, ":"), (-2, "--")):
        left.axhline(level, color="tab:gray", linestyle=style, linewidth=0.8)
    right.set_yscale("log")
    left.set_ylabel("EM - full (points): mean over worlds, bars worst..best world")
    right.set_ylabel("mean KL(full || variant), first answer token (log)")
    figure.suptitle(f"{report['model_label']}, {len(report['worlds'])} worlds x {report['questions']} questions, "
                    f"k = {report['k']}\no: no extra cost, s: extra bytes per chunk, ^: an extra pass; red: anchored "
                    "entries, purple: model-signal rules, blue: plain entries; dotted vertical: 2x seam@8's tokens",
                    fontsize=9)
    left.set_title("EM - full", fontsize=8)
    right.set_title("KL against full", fontsize=8)
    figure.tight_layout(rect=(0, 0, 1, 0.92))
    figure.savefig(path, dpi=120)
    plt.close(figure)


# ============================================================================================== main
def load_cases(seed: int, count: int, tokenizer: Any, k: int, progress: bool = True,
               test_bed: str = "default") -> list[Any]:
    """`count` held-out cases of worlds `seed`+ of `test_bed` (one of `TEST_BEDS`), retrieved with k chunks."""
    from training.heldout_retrieval import retrieved_cases, retrieved_cross_chunk_cases

    if test_bed not in TEST_BEDS:
        raise ValueError(f"unknown test bed {test_bed!r}; choose one of {', '.join(TEST_BEDS)}")
    source = retrieved_cross_chunk_cases if test_bed == "cross-chunk" else retrieved_cases
    return list(tqdm(source(seed, count, tokenizer, num_chunks=k), total=count, desc="retrieve",
                     file=sys.stderr, disable=not progress))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--test-bed", choices=TEST_BEDS, default="default", help="the worlds: `default` (one-chunk "
                        "documents) or `cross-chunk` (two-chunk documents whose second chunk never names its subject)")
    parser.add_argument("--model", type=Path, default=STAGE3_MODEL)
    parser.add_argument("--model-label", default=None, help="name in the table (default: the directory's)")
    parser.add_argument("--questions", type=int, default=200, help="questions per world")
    parser.add_argument("--seed", type=int, default=None, help="the world when --worlds is not given (default: the "
                        "test bed's held-out seed)")
    parser.add_argument("--worlds", default="", help="world seeds, comma-separated (each: --questions questions)")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--seam-tokens", type=int, default=8, help="the engine's (index's) seam")
    parser.add_argument("--variants", default=None, help="comma-separated POLICY[|RANKING] (default: the issue-20 "
                        "list for one world, `WORLD_VARIANTS` with --worlds)")
    parser.add_argument("--calibrate", default="", help="KL targets (comma-separated): calibrate on --calibration-"
                        "questions of worlds --calibration-seed with `hypic_rag.calibration.policy`, record the choice")
    parser.add_argument("--calibration-questions", type=int, default=50)
    parser.add_argument("--max-recompute", type=float, default=None, help="calibration chooses only among the "
                        "candidates recomputing at most X times the fixed seam's tokens per request (default: all)")
    parser.add_argument("--candidates", default="", help="calibration candidates, comma-separated specs (default: "
                        "`hypic_rag.runtime.recompute_policy.calibration_candidates`)")
    parser.add_argument("--calibration-seed", type=int, default=None, help="default: the test bed's calibration seed")
    parser.add_argument("--calibrate-only", action="store_true", help="calibrate (--calibrate) and stop: no world "
                        "is evaluated")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--recount-bytes", action="store_true", help="correct the bytes per chunk of the anchored "
                        "and chained rows of the report at --out in place (cases retrieved again, nothing rerun), "
                        "and rewrite --markdown from it")
    parser.add_argument("--index-bytes", action="store_true", help="precompute a plain, an anchored and a chained "
                        "index of the first world's documents (cross-chunk test bed), count the bytes per chunk their "
                        "LMDB stores hold, add them to the report at --out (kept otherwise) and rewrite --markdown")
    parser.add_argument("--resume", action="store_true", help="continue the run that wrote --out: its worlds and its "
                        "calibration are kept, only the worlds it lacks are evaluated (same model, questions, k)")
    args = parser.parse_args(argv)
    cross_chunk = args.test_bed == "cross-chunk"
    if args.seed is None:
        args.seed = CROSS_CHUNK_HELDOUT_SEED if cross_chunk else HELDOUT_SEED
    if args.calibration_seed is None:
        args.calibration_seed = CROSS_CHUNK_CALIBRATION_SEED if cross_chunk else CALIBRATION_SEED
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)

    from hypic_rag.runtime.engine import Engine
    from hypic_rag.runtime.model import load_model
    from training.packing import SegmentEncoder

    worlds = [int(seed) for seed in args.worlds.split(",") if seed.strip()] or [args.seed]
    model = load_model(args.model, device="cpu")
    engine = Engine(model, seam_tokens=args.seam_tokens, memory_cache_bytes=4 << 30)
    stop = SegmentEncoder(model.tokenizer).prompt_format.answer_stop
    if args.recount_bytes:
        if args.out is None:
            parser.error("--recount-bytes corrects the report at --out: give --out")
        text = report_markdown(recount_bytes(args.out, engine))
        if args.markdown:
            args.markdown.write_text(text)
        print(text)
        return 0
    if args.index_bytes:
        if not cross_chunk or args.out is None:
            parser.error("--index-bytes measures the cross-chunk test bed's index into the report at --out: give "
                         "--test-bed cross-chunk and --out")
        report = json.loads(args.out.read_text()) if args.out.exists() else {}
        report["index_bytes"] = cross_chunk_index_bytes(args.model, worlds[0], args.seam_tokens)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        text = report_markdown(report)
        if args.markdown:
            args.markdown.write_text(text)
        print(text)
        return 0
    listed = args.variants or (WORLD_VARIANTS if args.worlds else DEFAULT_VARIANTS)
    variants = [parse_variant(text, args.seam_tokens) for text in listed.split(",") if text.strip()]
    started = time.perf_counter()
    header: dict[str, Any] = {
        "model": str(args.model), "model_label": args.model_label or args.model.name, "questions": args.questions,
        "k": args.k, "seam_tokens": args.seam_tokens,
    }
    if cross_chunk:  # the default test bed's reports keep their layout
        header["test_bed"] = args.test_bed
    calibration, world_reports = None, []
    if args.resume:
        calibration, world_reports = resumed_report(args.out, header)
    if args.calibrate and calibration is None:
        calibration = calibrate_on_worlds(engine, args, stop)
        if args.calibrate_only:
            report = {**header, "calibration": calibration, "seconds": round(time.perf_counter() - started, 1)}
            text = calibration_markdown(calibration)
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(report, indent=2) + "\n")
            if args.markdown:
                args.markdown.write_text(text)
            print(text)
            return 0
    for choice in calibration["choices"] if calibration else []:
        label = choice["chosen"]
        if label not in {variant.label for variant in variants}:
            variants.append(parse_variant(label, args.seam_tokens))
    done = {world["seed"] for world in world_reports}
    for seed in [seed for seed in worlds if seed not in done]:
        began = time.perf_counter()
        cases = load_cases(seed, args.questions, model.tokenizer, args.k, test_bed=args.test_bed)
        world = {**header, "seed": seed, "gold_recall": sum(case.gold_retrieved for case in cases) / len(cases)}
        if cross_chunk:
            world["needed_recall"] = needed_recall(cases)
        world.update(evaluate(engine, cases, variants, stop))
        del world["full_answers"]  # not kept (the rows hold the summaries)
        world["seconds"] = round(time.perf_counter() - began, 1)
        world_reports.append(world)
        if args.out:  # after every world: a long run stopped early keeps what it measured
            _write_report(args.out, header, world_reports, calibration, started)
    report = _write_report(args.out, header, world_reports, calibration, started)
    text = report_markdown(report)
    if args.markdown:
        args.markdown.write_text(text)
    if args.plot:
        (plot if len(world_reports) == 1 else plot_worlds)(world_reports[0] if len(world_reports) == 1 else report,
                                                            args.plot)
    print(text)
    return 0


def report_markdown(report: dict[str, Any]) -> str:
    """The markdown of a report: its worlds' tables (one world's, or the multi-world one), its calibration and its
    index bytes, whichever it holds."""
    parts = []
    if "worlds" in report:
        parts.append(worlds_markdown(report))
    elif "rows" in report:
        parts.append(markdown_table(report))
    if report.get("calibration"):
        parts.append(calibration_markdown(report["calibration"]))
    if report.get("index_bytes"):
        parts.append(index_bytes_markdown(report["index_bytes"]))
    return "\n".join(parts)


def _write_report(path: Path | None, header: dict[str, Any], worlds: list[dict[str, Any]],
                  calibration: dict[str, Any] | None, started: float) -> dict[str, Any]:
    """The report so far (one world: that world's report, as issue 20's files; several: `worlds` and `summary`),
    written to `path` when given."""
    if len(worlds) == 1:
        report = dict(worlds[0])
    else:
        report = {**header, "worlds": worlds, "summary": summarize_worlds(worlds)}
    if calibration is not None:
        report["calibration"] = calibration
    if path is not None and path.exists():  # measured apart (--index-bytes): kept
        measured = json.loads(path.read_text()).get("index_bytes")
        if measured is not None:
            report["index_bytes"] = measured
    report["seconds"] = round(time.perf_counter() - started, 1)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
    return report


def recount_bytes(path: Path, engine: Any) -> dict[str, Any]:
    """Correct the `extra_bytes_per_chunk` of the anchored and chained rows of the report at `path` in place:
    each world's cases retrieved again (the same seeds, questions and k) and the bytes counted from the entry
    keys' lengths (`anchored_bytes_per_chunk`); answers, KL and tokens are kept (the bytes do not change them)."""
    from training.packing import SegmentEncoder

    report = json.loads(path.read_text())
    worlds = report["worlds"] if "worlds" in report else [report]
    encoder = SegmentEncoder(engine.model.tokenizer)
    for world in worlds:
        cases = load_cases(world["seed"], world["questions"], engine.model.tokenizer, world["k"],
                           test_bed=world.get("test_bed", "default"))
        requests = build_requests(cases, encoder)
        for label, row in world["rows"].items():
            policy = parse_variant(label, world["seam_tokens"]).policy
            if getattr(policy, "anchored", False):
                seam = parse_variant(label, world["seam_tokens"]).seam
                row["extra_bytes_per_chunk"] = sum(anchored_bytes_per_chunk(engine, request, seam, policy)
                                                   for request in requests) / len(requests)
                print(f"world {world['seed']}, {label}: {row['extra_bytes_per_chunk']:.0f} bytes per chunk",
                      file=sys.stderr)
    if "worlds" in report:
        report["summary"] = summarize_worlds(worlds)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return report


def resumed_report(path: Path | None, header: dict[str, Any]) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """(calibration, world reports) of the report at `path` written by an earlier run with the same `header`
    (model, questions, k, seam); (None, []) when there is none. ValueError when it was made with another header."""
    if path is None or not path.exists():
        return None, []
    report = json.loads(path.read_text())
    for name in ("model", "questions", "k", "seam_tokens", "test_bed"):
        if report.get(name) != header.get(name):
            raise ValueError(f"--resume: {path} has {name} {report.get(name)!r}, this run {header[name]!r}")
    worlds = report["worlds"] if "worlds" in report else \
        [{name: value for name, value in report.items() if name != "calibration"}]
    return report.get("calibration"), worlds


def calibration_markdown(calibration: dict[str, Any]) -> str:
    """The candidates' calibration scores (cheapest first) and the choice per KL target."""
    choices = calibration["choices"]
    cap = calibration.get("max_recompute")
    lines = [f"Calibration on {calibration['questions']} questions of worlds {calibration['seed']}+ "
             "(the runtime's `calibrate`, requests ranked as the pipeline ranks)"
             + (f", choosing among the candidates recomputing at most {cap:g}x the fixed seam's tokens "
                f"({choices[0]['token_cap']:.1f} per request)" if cap is not None and choices else "") + ".", "",
             "| candidate | recomputed tokens / request | mean KL | max KL | top-1 agreement |",
             "| --- | --- | --- | --- | --- |"]
    for candidate in choices[0]["candidates"] if choices else []:
        lines.append(f"| {candidate['spec']} | {candidate['recomputed_tokens']:.1f} | {candidate['mean_kl']:.4f} | "
                     f"{candidate['max_kl']:.4f} | {100 * candidate['top1_agreement']:.1f}% |")
    lines += ["", "| KL target | chosen | met |", "| --- | --- | --- |"]
    lines += [f"| {choice['kl_target']:g} | {choice['policy']} | {'yes' if choice['met'] else 'no'} |"
              for choice in choices]
    return "\n".join(lines) + "\n"


def calibrate_on_worlds(engine: Any, args: argparse.Namespace, stop: str) -> dict[str, Any]:
    """The runtime's calibration on the calibration worlds' questions (their real retrieval, ranked as the
    pipeline ranks), one choice per KL target."""
    import dataclasses

    from hypic_rag.pipeline.answering import retrieval_ranks
    from hypic_rag.calibration.policy import calibrate
    from training.packing import SegmentEncoder

    cases = load_cases(args.calibration_seed, args.calibration_questions, engine.model.tokenizer, args.k,
                       test_bed=args.test_bed)
    requests = [dataclasses.replace(request, chunk_ranks=retrieval_ranks(case.from_hop))
                for request, case in zip(build_requests(cases, SegmentEncoder(engine.model.tokenizer)), cases)]
    choices = []
    targets = [float(value) for value in args.calibrate.split(",") if value.strip()]
    measured = None
    candidates = [spec.strip() for spec in args.candidates.split(",") if spec.strip()] or None
    for target in targets:
        result = calibrate(engine, requests, candidates, target, measured=measured, max_recompute=args.max_recompute)
        measured = result.candidates
        spec = result.chosen.resolved(args.seam_tokens).spec if result.chosen.kind == "seam" else result.chosen.spec
        choices.append({"kl_target": target, "chosen": spec if result.chosen.kind == "seam" else f"{spec}|alternate",
                        **result.to_dict()})
    return {"questions": len(cases), "seed": args.calibration_seed, "max_recompute": args.max_recompute,
            "choices": choices}


if __name__ == "__main__":
    raise SystemExit(main())
