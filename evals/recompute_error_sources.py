"""Where a composed prompt's error comes from (issue 29): substitute in-context tensors for cached ones, part by part.

For each held-out question (the test bed of `evals/recompute_policies.py`: real retrieval, k = 8) the prompt is
assembled at seam 0 from cached entries, then again with some of each chunk's cached tensors replaced by their
*in-context* values, taken from `full`'s own pass (each layer's inputs captured there, the chunk's suffix pair,
conv tail and K/V recomputed from them exactly as encoding does). No runtime can do this (it needs the full pass);
it measures which cached part costs the answer: replacing everything gives `full` back, and replacing a part
that does not matter changes nothing. Also measured, as entries a runtime *can* make: the chunk encoded after the
prompt prefix (`anchored`, `hypic_rag.runtime.anchoring`) or after the prefix and a generic sentence.

Parts: `kv:L` (keys and values of attention layer L), `kv` (every attention layer), `linear` (every recurrent
layer's suffix pair and conv tail), `linear<L` / `linear>L` (those before / after layer L), `gold` (everything, for
the gold documents' chunks only), `kv-last@att:M` (the last attention layer's K/V of the M chunk tokens the
question attends to most in the seam-0 pass), `kv-last@dev:M` (of the M tokens whose K/V moved most), `anchored`,
`anchored+generic`.

On the cross-chunk test bed (`--test-bed cross-chunk`: two-chunk documents whose second chunk never names its
subject) also: `dependent` / `antecedent` / `neither` (everything, for the chunks that follow their document's
previous chunk in the prompt / that such a chunk follows / the others), and what runtime plans recover, each one
part recomputed or re-encoded at a time: `plan:SPEC` (a runtime policy: `seam@8`, `seam@0+anchored`,
`seam@0+chained`, ...), `whole:dependent` / `whole:antecedent` (those chunks recomputed whole in context, the others
from anchored entries at seam 0), `seam@W:dependent` (seams sized per chunk: W tokens of each dependent chunk
recomputed, the others at seam 0, anchored entries).

    OMP_WAIT_POLICY=PASSIVE python -m evals.recompute_error_sources --seed 930000000 --questions 200 \\
        --out docs/benchmarks/recompute_error_sources.json --markdown docs/benchmarks/recompute_error_sources.md
    OMP_WAIT_POLICY=PASSIVE python -m evals.recompute_error_sources --test-bed cross-chunk --seed 920000000 \\
        --questions 200 --model evals/cross_chunk_model --out docs/benchmarks/recompute_error_sources_cross_chunk.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

GENERIC_CONTEXT = "Note: the documents below are about people, places, organisations and products."
"""A generic sentence placed between the prefix and the chunk for the `anchored+generic` entries."""

Selector = Callable[[int, str], bool]
"""(chunk number, tensor name) -> take the in-context tensor?"""
CROSS_CHUNK_PLANS = ("seam@8", "seam@8+anchored", "seam@0+anchored", "seam@0+chained", "seam@8+chained")
"""The runtime policies measured on the cross-chunk test bed beside the substitutions."""


@dataclass(frozen=True, slots=True)
class ChunkSeams:
    """Study rule: chunk i at seam `seams[i]` (None: recomputed whole), read from anchored entries (a plan-like rule
    the engine accepts as a policy): whole chunks or seams sized per chunk."""

    seams: tuple[int | None, ...]
    anchored: bool = True

    def plan(self, chunk_lengths: Sequence[int], default_seam: int, ranks: Sequence[int] = ()):
        from hypic_rag.runtime.recompute_policy import RecomputePlan

        return RecomputePlan(self.seams)


class _LayerInputs:
    """Captures every mixer's input rows [T, hidden] of one stack pass (wrapping the stack's mixer functions)."""

    def __init__(self) -> None:
        from hypic_rag.runtime import stack

        self.stack = stack
        self.inputs: dict[int, torch.Tensor] = {}
        self.active = False
        self._recurrent, self._attention = stack.recurrent_layer, stack._attention_layer

        def recurrent(mixer, layer_index, x, *rest):  # noqa: ANN001, ANN002, ANN202
            if self.active:
                self.inputs[layer_index] = x.detach().clone()
            return self._recurrent(mixer, layer_index, x, *rest)

        def attention(mixer, layer_index, x, *rest):  # noqa: ANN001, ANN002, ANN202
            if self.active:
                self.inputs[layer_index] = x.detach().clone()
            return self._attention(mixer, layer_index, x, *rest)

        # the stack's pass looks both layer functions up in its module at call time
        stack.recurrent_layer, stack._attention_layer = recurrent, attention

    def capture(self, model: Any, token_ids: list[int]) -> dict[int, torch.Tensor]:
        """Each layer's mixer input rows of a plain pass over `token_ids`."""
        self.inputs, self.active = {}, True
        try:
            self.stack.run_stack(model, [self.stack.Span(list(token_ids), 0, len(token_ids))])
        finally:
            self.active = False
        return self.inputs


@torch.no_grad()
def in_context_parts(model: Any, inputs: dict[int, torch.Tensor], begin: int, end: int) -> dict[str, torch.Tensor]:
    """The seam-0 entry tensors of tokens begin..end-1 computed from layer inputs [T, hidden] of a pass over a
    longer sequence (their conv sees the inputs before `begin`)."""
    from hypic_rag.entry.schema import tensor_name
    from hypic_rag.runtime import layers as L

    parts: dict[str, torch.Tensor] = {}
    for layer_index, block in enumerate(model.blocks):
        x = inputs.get(layer_index)
        if x is None:
            continue
        if block.recurrent is not None:
            mixer = block.recurrent
            projections = mixer.project(x[begin:end])
            context = mixer.empty_conv_tail(x.device)
            if begin > 0 and mixer.conv_width:
                context = L.advance_conv_tail(context, mixer.project(x[max(0, begin - mixer.conv_width):begin]).preconv)
            convolved = mixer.convolve(projections.preconv[None], context[None])
            run = mixer.run_with_transition(mixer.recurrence_inputs(convolved, projections.map(lambda t: t[None])))
            parts[tensor_name(layer_index, "transition")] = run.segment.transition[0]
            parts[tensor_name(layer_index, "suffix_state")] = run.segment.state[0]
            parts[tensor_name(layer_index, "conv_tail")] = L.advance_conv_tail(mixer.empty_conv_tail(x.device),
                                                                               projections.preconv)
        if block.attention is not None:
            projections = block.attention.project(x[begin:end])
            parts[tensor_name(layer_index, "key")] = projections.key
            parts[tensor_name(layer_index, "value")] = projections.value
    return parts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="default: evals/stage3_model")
    parser.add_argument("--test-bed", choices=("default", "cross-chunk"), default="default")
    parser.add_argument("--seed", type=int, default=930_000_000)
    parser.add_argument("--questions", type=int, default=200)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)

    from evals.policy_signals import QuestionAttention, chunk_spans, last_attention_layer
    from evals.recompute_policies import (
        STAGE3_MODEL,
        build_requests,
        greedy_decode,
        load_cases,
        paired_difference,
    )
    from hypic_rag.entry.schema import is_kv_name, tensor_name
    from hypic_rag.runtime.anchoring import anchor_of
    from hypic_rag.runtime.engine import Engine, PrefillStats
    from hypic_rag.runtime.model import load_model
    from hypic_rag.runtime.quality import kl_divergence
    from hypic_rag.runtime.stack import run_batch
    from training.evaluate import EvalItem
    from training.packing import SegmentEncoder

    model_path = args.model or STAGE3_MODEL
    model = load_model(model_path, device="cpu")
    engine = Engine(model, seam_tokens=0, memory_cache_bytes=4 << 30)
    encoder = SegmentEncoder(model.tokenizer)
    stop = encoder.prompt_format.answer_stop
    capture = _LayerInputs()
    attention_layers = [i for i, block in enumerate(model.blocks) if block.attention is not None]
    recurrent_layers = [i for i, block in enumerate(model.blocks) if block.recurrent is not None]
    last = last_attention_layer(model)
    last_kv = (tensor_name(last, "key"), tensor_name(last, "value"))
    layer_of = lambda name: int(name.split(".")[1])  # noqa: E731
    cases = load_cases(args.seed, args.questions, model.tokenizer, args.k, test_bed=args.test_bed)
    requests = build_requests(cases, encoder)
    flags: dict[str, list[bool]] = {}
    kls: dict[str, list[float]] = {}
    recomputed: dict[str, list[int]] = {}
    started = time.perf_counter()
    for case, request in tqdm(list(zip(cases, requests)), desc="questions", file=sys.stderr):
        full = engine.prefill(request, "full")
        full_flag = EvalItem(case.question, greedy_decode(engine, full.logits, full.state, stop)).exact
        flags.setdefault("full", []).append(full_flag)
        inputs = capture.capture(model, request.all_ids())
        spans = chunk_spans(request)
        truth = [in_context_parts(model, inputs, begin, end) for begin, end in spans]
        cached = engine.fetch_entries(request.chunk_ids, 0, PrefillStats(mode="study"))
        gold = [doc in case.question.gold_doc_ids for doc in case.retrieved_doc_ids]

        def conditioned(context: list[int]) -> list[dict[str, torch.Tensor]]:
            made = []
            for chunk in request.chunk_ids:
                layer_inputs = capture.capture(model, context + list(chunk))
                made.append(in_context_parts(model, layer_inputs, len(context), len(context) + len(chunk)))
            return made

        def measure(name: str, sources: list[dict[str, torch.Tensor]], select: Selector,
                    rows: list[torch.Tensor | None] | None = None) -> None:
            provided = {}
            for number, (chunk, entry) in enumerate(zip(request.chunk_ids, cached)):
                mixed = dict(entry)
                for tensor, value in sources[number].items():
                    if not select(number, tensor):
                        continue
                    if rows is not None:  # only some token rows of a K/V tensor
                        if rows[number] is None:
                            continue
                        value = entry[tensor].clone()
                        value[:, rows[number]] = sources[number][tensor][:, rows[number]]
                    mixed[tensor] = value
                provided[(0, tuple(chunk))] = mixed
            plan = engine.plan_prefill(request, "hypic", policy="seam@0", provided=provided)
            result = engine.finish_prefill(plan, run_batch(model, [plan.item()])[0])
            answer = greedy_decode(engine, result.logits, result.state, stop)
            flags.setdefault(name, []).append(EvalItem(case.question, answer).exact)
            kls.setdefault(name, []).append(kl_divergence(full.logits, result.logits))

        measure("cached (seam 0)", truth, lambda n, t: False)
        measure("everything", truth, lambda n, t: True)
        measure("kv", truth, lambda n, t: is_kv_name(t))
        for layer in attention_layers:
            measure(f"kv:{layer}", truth, lambda n, t, layer=layer: is_kv_name(t) and layer_of(t) == layer)
        measure("linear", truth, lambda n, t: not is_kv_name(t))
        measure(f"linear<{attention_layers[0]}", truth,
                lambda n, t: not is_kv_name(t) and layer_of(t) < attention_layers[0])
        measure(f"linear>{attention_layers[0]}", truth,
                lambda n, t: not is_kv_name(t) and layer_of(t) > attention_layers[0])
        measure("gold", truth, lambda n, t: gold[n])
        # token selection in the last attention layer: by the question's attention (seam-0 pass) or by how far
        # the cached K/V are from the in-context ones (an oracle signal)
        plan = engine.plan_prefill(request, "hypic", policy="seam@0")
        observer = QuestionAttention(len(request.question_ids))
        item = plan.item()
        item.observe_attention = observer
        run_batch(model, [item])
        attention = observer.mass[last]
        tokens = []
        for number, (begin, end) in enumerate(spans):
            moved = sum((truth[number][name] - cached[number][name]).pow(2).sum(dim=(0, 2)) for name in last_kv)
            tokens += [(number, row, float(attention[begin + row]), float(moved[row])) for row in range(end - begin)]
        for count in (16, 64, 128):
            for label, key in (("att", 2),) if args.test_bed == "cross-chunk" else (("att", 2), ("dev", 3)):
                picked = sorted(tokens, key=lambda item: -item[key])[:count]
                rows: list[torch.Tensor | None] = [None] * len(spans)
                for number in range(len(spans)):
                    mine = [row for chunk, row, *_ in picked if chunk == number]
                    rows[number] = torch.tensor(mine) if mine else None
                measure(f"kv-last@{label}:{count}", truth, lambda n, t: t in last_kv, rows)
        prefix = list(request.prefix_ids)
        anchored = conditioned(anchor_of(prefix))
        measure("anchored", anchored, lambda n, t: True)
        if args.test_bed == "default":
            measure("anchored+generic", conditioned(prefix + encoder.chunk(GENERIC_CONTEXT)), lambda n, t: True)
        if args.test_bed == "cross-chunk":  # (the generic context and the deviation selection: default test bed only)
            count = len(request.chunk_ids)
            dependent = tuple(bool(request.chunk_follows and request.chunk_follows[n]) for n in range(count))
            antecedent = tuple(n + 1 < count and dependent[n + 1] for n in range(count))
            measure("dependent", truth, lambda n, t: dependent[n])
            measure("antecedent", truth, lambda n, t: antecedent[n])
            measure("neither", truth, lambda n, t: not dependent[n] and not antecedent[n])
            rules = [(f"plan:{spec}", spec) for spec in CROSS_CHUNK_PLANS]
            rules += [("whole:dependent", ChunkSeams(tuple(None if flag else 0 for flag in dependent))),
                      ("whole:antecedent", ChunkSeams(tuple(None if flag else 0 for flag in antecedent)))]
            rules += [(f"seam@{width}:dependent", ChunkSeams(tuple(width if flag else 0 for flag in dependent)))
                      for width in (8, 16)]
            for name, rule in rules:
                result = engine.prefill(request, "hypic", policy=rule)
                answer = greedy_decode(engine, result.logits, result.state, stop)
                flags.setdefault(name, []).append(EvalItem(case.question, answer).exact)
                kls.setdefault(name, []).append(kl_divergence(full.logits, result.logits))
                recomputed.setdefault(name, []).append(result.stats.recomputed_tokens)
    rows_out = {}
    for name in kls:
        difference = paired_difference(flags[name], flags["full"])
        rows_out[name] = {"exact_match": sum(flags[name]) / len(flags[name]), "kl": sum(kls[name]) / len(kls[name]),
                          **difference}
        if name in recomputed:
            rows_out[name]["recomputed_tokens"] = sum(recomputed[name]) / len(recomputed[name])
        kinds = [getattr(case.question, "kind", None) for case in cases]
        if "cross" in kinds:
            rows_out[name]["cross_exact_match"] = sum(flag for flag, kind in zip(flags[name], kinds)
                                                      if kind == "cross") / kinds.count("cross")
            rows_out[name]["cross_em_minus_full"] = rows_out[name]["cross_exact_match"] - sum(
                flag for flag, kind in zip(flags["full"], kinds) if kind == "cross") / kinds.count("cross")
    report = {"model": str(model_path), "test_bed": args.test_bed, "seed": args.seed, "questions": len(requests), "k": args.k,
              "full_exact_match": sum(flags["full"]) / len(flags["full"]), "attention_layers": attention_layers,
              "recurrent_layers": recurrent_layers, "rows": rows_out,
              "seconds": round(time.perf_counter() - started, 1)}
    lines = [f"{len(requests)} questions (seed {args.seed}), k = {args.k}, `{Path(model_path).name}`; every chunk at "
             f"seam 0; `full` EM {100 * report['full_exact_match']:.1f}%. Parts replaced by their in-context values:",
             "", "| parts in context | EM | EM - full [95% paired] | KL(full ‖ ·) |"
             + (" EM - full, cross-chunk questions | recomputed tokens |" if args.test_bed == "cross-chunk" else ""),
             "| --- | --- | --- | --- |" + (" --- | --- |" if args.test_bed == "cross-chunk" else "")]
    for name, row in rows_out.items():
        low, high = row["em_minus_full_ci95"]
        line = (f"| {name} | {100 * row['exact_match']:.1f}% | {100 * row['em_minus_full']:+.1f} "
                f"[{100 * low:+.1f}, {100 * high:+.1f}] | {row['kl']:.4f} |")
        if args.test_bed == "cross-chunk":
            tokens = row.get("recomputed_tokens")
            line += f" {100 * row.get('cross_em_minus_full', 0.0):+.1f} | {'' if tokens is None else f'{tokens:.1f}'} |"
        lines.append(line)
    text = "\n".join(lines) + "\n"
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    if args.markdown:
        args.markdown.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
