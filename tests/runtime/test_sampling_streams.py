"""Sampling and streaming in the engine, on a tiny random model with a real tokenizer: probabilities stay finite
at any valid temperature / top_p (a tiny temperature is greedy), seeds are unsigned 64-bit and reproduce, an
unseeded generation draws fresh randomness, and streamed deltas add up exactly to the final text (stop strings
that start inside an earlier token included; a stripped RAG answer streams stripped)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from hypic_rag.prompting.layout import split_trailing_space
from hypic_rag.prompting.matching import Piece, segment_prompt
from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.generation import Generation, GenerationStream, without_lead
from hypic_rag.runtime.model import load_model
from hypic_rag.runtime.request import Request
from hypic_rag.runtime.sampling import SamplingParams, sampling_probabilities
from hypic_rag.utils.streaming import ResultStream, StrippedDeltas, drain

TEMPERATURES = [5e-324, 1e-45, 1e-30, 1e-6, 0.01, 0.7, 1.0, 5.0, 1e6, 1e300]
TOP_PS = [1e-12, 0.1, 0.5, 0.999, 1.0]


@pytest.fixture(scope="module")
def engine(tiny_model: Path) -> Engine:
    model = load_model(tiny_model, device="cpu")
    return Engine(model, seam_tokens=4)


def request_of(engine: Engine, *texts: str) -> Request:
    """Segments `texts[:-1]` and the query `texts[-1]`, each tokenized on its own."""
    tokenizer = engine.model.tokenizer
    ids = [list(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]
    return Request([], ids[:-1], ids[-1])


def streamed(engine: Engine, request: Request, params: SamplingParams) -> tuple[list[str], object]:
    deltas: list[str] = []
    generation = drain(engine.stream(request, "hypic", params), lambda item: deltas.append(item[1]))
    return deltas, generation


# ------------------------------------------------------------------------------------------------ probabilities
@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_probabilities_are_finite_at_any_valid_temperature_and_top_p(temperature: float) -> None:
    """Logits [vocab] with huge, near-tied and -inf entries: never inf/nan, sums to 1, -inf stays impossible."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(256, generator=generator) * 30
    logits[3] = logits.max() + 1e-3  # a near tie with the top
    logits[7] = float("-inf")  # a masked token
    logits[11] = -3e38
    for top_p in TOP_PS:
        probabilities = sampling_probabilities(logits, temperature, top_p)
        assert torch.isfinite(probabilities).all(), (temperature, top_p)
        assert (probabilities >= 0).all() and abs(float(probabilities.sum()) - 1.0) < 1e-9
        assert probabilities[7] == 0 and (probabilities[3] > 0 or top_p < 1)
        torch.multinomial(probabilities, 1, generator=generator)  # raised on inf/nan before


@pytest.mark.parametrize("temperature", [5e-324, 1e-45, 1e-30])
def test_a_tiny_temperature_is_greedy(engine: Engine, temperature: float) -> None:
    request = request_of(engine, "Bob Tanaka is an astronomer.", "Who is an astronomer?")
    greedy = engine.generate(request, "hypic", SamplingParams(max_new_tokens=8))
    tiny = engine.generate(request, "hypic", SamplingParams(max_new_tokens=8, temperature=temperature))
    assert tiny.token_ids == greedy.token_ids


@pytest.mark.parametrize(
    "options",
    [{"seed": 2**64}, {"seed": -1}, {"seed": -(2**70)}, {"seed": 1.5}, {"temperature": float("nan")},
     {"temperature": float("inf")}, {"top_p": float("nan")}, {"top_p": 0.0}],
)
def test_out_of_range_sampling_params_are_refused(options: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(options))):
        SamplingParams(**options)


# ------------------------------------------------------------------------------------------------ randomness
def test_unseeded_sampling_is_fresh_and_a_seed_reproduces(engine: Engine) -> None:
    request = request_of(engine, "Carol grows lavender near the river Vell.", "Who grows lavender?")

    def sample(seed: int | None) -> tuple[int, ...]:
        params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=seed)
        return tuple(engine.generate(request, "hypic", params).token_ids)

    unseeded = {sample(None) for _ in range(5)}
    assert len(unseeded) > 1, "five unseeded samples were all the same"
    for seed in (0, 123, 2**64 - 1):
        assert len({sample(seed) for _ in range(3)}) == 1, seed
    assert sample(1) != sample(2)


# ------------------------------------------------------------------------------------------------ streamed text
def test_deltas_add_up_to_the_text_when_a_stop_string_starts_inside_an_earlier_token(engine: Engine) -> None:
    request = request_of(engine, "Dmitri repairs vintage bicycles in Harrow Cove.", "Who repairs bicycles?")
    free = engine.generate(request, "hypic", SamplingParams(max_new_tokens=24))
    tokenizer = engine.model.tokenizer
    text = free.text
    # token boundaries in the text: where the decoded prefix of the first n tokens ends
    boundaries = sorted({len(tokenizer.decode(free.token_ids[:n], skip_special_tokens=True))
                         for n in range(1, len(free.token_ids))})
    stops = [text[b - 1 : b + 1] for b in boundaries
             if 0 < b < len(text) and text.find(text[b - 1 : b + 1]) == b - 1 and "\ufffd" not in text[b - 1 : b + 1]]
    assert stops, f"no stop string spans a token boundary in {text!r}"
    for stop in stops[:4]:
        deltas, generation = streamed(engine, request, SamplingParams(max_new_tokens=24, stop_strings=(stop,)))
        assert generation.finish_reason == "stop"
        assert generation.text == text[: text.find(stop)], stop
        assert "".join(deltas) == generation.text, (stop, deltas)


@pytest.mark.parametrize("seed", [None, 7])
def test_sampled_deltas_add_up_to_the_text(engine: Engine, seed: int | None) -> None:
    request = request_of(engine, "Mount Keral is a dormant volcano.", "When did it erupt?")
    params = SamplingParams(max_new_tokens=16, temperature=1.5, top_p=0.9, seed=seed, stop_strings=("ol", "\n"))
    for _ in range(3):
        deltas, generation = streamed(engine, request, params)
        assert "".join(deltas) == generation.text


def test_stripped_deltas_add_up_to_the_stripped_text() -> None:
    rng = random.Random(5)
    alphabet = [" ", "\n", "\t", "a", "b", "\u00a0", "\u3000", "é"]
    for _ in range(500):
        deltas = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4))) for _ in range(rng.randint(0, 8))]
        stripper = StrippedDeltas()
        assert "".join(stripper.feed(delta) for delta in deltas) == "".join(deltas).strip(), deltas
    stripper = StrippedDeltas()
    pieces = [stripper.feed(d) for d in [" ", " Naikeaton", " ", "Lebrios", "\n "]]
    assert pieces == ["", "Naikeaton", "", " Lebrios", ""]


# ------------------------------------------------------------------------------------------------ stream objects
class Stop(Exception):
    """What the checks below raise (a deadline or a cancellation in the service)."""


def test_a_generation_stream_yields_pairs_then_holds_its_generation(engine: Engine) -> None:
    request = request_of(engine, "Ines paints lighthouses in Porto Sal.", "Who paints lighthouses?")
    stream = engine.stream(request, "hypic", SamplingParams(max_new_tokens=6))
    assert isinstance(stream, GenerationStream)
    with pytest.raises(RuntimeError, match="not ended yet"):
        stream.result  # noqa: B018 (the property raises)
    items = list(stream)
    assert items and all(isinstance(token, int) and isinstance(delta, str) for token, delta in items)
    generation = stream.result
    assert isinstance(generation, Generation) and stream.finished
    assert "".join(delta for _, delta in items) == generation.text
    assert [token for token, _ in items][: len(generation.token_ids)] == generation.token_ids
    assert generation.token_ids == engine.generate(request, "hypic", SamplingParams(max_new_tokens=6)).token_ids
    assert list(stream) == [] and stream.result is generation  # an ended stream stays ended


def test_closing_a_stream_stops_it_early(engine: Engine) -> None:
    request = request_of(engine, "Ines paints lighthouses in Porto Sal.", "Who paints lighthouses?")
    with engine.stream(request, "hypic", SamplingParams(max_new_tokens=12)) as stream:
        first = next(stream)
    assert isinstance(first[0], int)
    assert list(stream) == [] and not stream.finished  # closed before the end: no generation to read
    with pytest.raises(RuntimeError, match="closed before its end"):
        stream.result  # noqa: B018


def test_the_check_runs_before_every_step(engine: Engine) -> None:
    request = request_of(engine, "Ines paints lighthouses in Porto Sal.", "Who paints lighthouses?")
    engine.generate(request, "hypic", SamplingParams(max_new_tokens=1))  # every entry cached: no segment checks
    calls: list[int] = []

    def check() -> None:
        calls.append(len(calls))
        if len(calls) > 3:
            raise Stop

    stream = engine.stream(request, "hypic", SamplingParams(max_new_tokens=10, stop_token_ids=()), check=check)
    received = []
    with pytest.raises(Stop):
        for item in stream:
            received.append(item)
    # checked before the first step, once more when the prefill has its entries (before assembly), then before
    # each later step: the fourth check comes before the third token
    assert len(received) == 2 and len(calls) == 4
    assert list(stream) == []  # what the check raised closed the stream


def test_a_check_that_raises_while_segments_are_encoded_stops_there_and_keeps_none(engine: Engine) -> None:
    """The per-step check is also the check between segment encodings (what the service's deadline uses)."""
    texts = ["Olu keeps bees on Farrow Hill.", "Pia tunes organs in Lisle.", "Quade maps caves near Orm.", "Who?"]
    engine = Engine(engine.model, seam_tokens=4, encode_batch_tokens=1)  # one segment per encoding batch
    request = request_of(engine, *texts)
    source = engine.segment_source
    assert source.missing_segments(request.chunk_ids, engine.seam_tokens) == request.chunk_ids
    calls: list[int] = []

    def check() -> None:
        calls.append(len(calls))
        if len(calls) == 3:  # 1: before the first step; 2, 3, 4: before each chunk's encoding batch
            raise Stop

    with pytest.raises(Stop):
        engine.generate(request, "hypic", SamplingParams(max_new_tokens=4), check=check)
    assert len(calls) == 3
    assert source.missing_segments(request.chunk_ids, engine.seam_tokens) == request.chunk_ids  # none kept
    done = engine.generate(request, "hypic", SamplingParams(max_new_tokens=4), check=lambda: None)
    assert done.prefill.cache_misses == 3 and source.missing_segments(request.chunk_ids, engine.seam_tokens) == []


def test_drain_runs_a_stream_object_or_a_bare_generator() -> None:
    def steps():
        yield 1
        yield 2
        return "done"

    seen: list[int] = []
    assert drain(steps(), seen.append) == "done" and seen == [1, 2]
    stream = ResultStream(steps())
    assert drain(stream) == "done" and stream.result == "done"


# ------------------------------------------------------------------------------------------------ prompt's end
def test_without_lead_settles_once_and_never_changes_what_it_gave() -> None:
    """The answer's text as tokens arrive after a prompt whose trailing space was taken off: the space is left out
    when the model writes it, nothing is left out when it does not, and text once given is never taken back."""
    assert [without_lead(text, " ") for text in ("", " ", " di", " diving")] == ["", "", "di", "diving"]
    assert [without_lead(text, " ") for text in ("\n", "\nx")] == ["\n", "\nx"]
    assert [without_lead(text, " \t") for text in (" ", " \t", " \tx", " x")] == ["", "", "x", " x"]
    assert without_lead(" x", "") == " x"
    assert split_trailing_space("Answer: ") == ("Answer:", " ")
    assert split_trailing_space("Answer:\n") == ("Answer:\n", "")
    assert split_trailing_space(" \t") == (" \t", "")  # nothing else: kept as it is


def test_a_prompt_ending_in_a_space_is_answered_as_the_prompt_without_it(engine: Engine) -> None:
    """A query ending in a space (LlamaIndex's QA template ends in "Answer: ") is the request of the query without
    it, and the answer leaves out the space the model then writes first, so prompt + answer reads as sent;
    streamed deltas add up to the same text. When the model's first token does not start with the space nothing is
    left out."""
    tokenizer = engine.model.tokenizer
    chunk, prompt = Piece("The champion is Ada.\n", explicit=True), "Who is the champion of the chess club?\nAnswer:"
    spaced = segment_prompt(tokenizer, [chunk, Piece(prompt + " ")]).request
    plain = segment_prompt(tokenizer, [chunk, Piece(prompt)]).request
    assert (spaced.question_ids, spaced.chunk_ids, spaced.answer_lead) == (plain.question_ids, plain.chunk_ids, " ")
    assert plain.answer_lead == ""
    texts = {token: tokenizer.decode([token]) for token in range(len(tokenizer))}
    space_word = next(token for token, text in texts.items() if text.startswith(" ") and text[1:].isalpha())
    word = next(token for token, text in texts.items() if text.isalpha())
    params = SamplingParams(max_new_tokens=3, logit_bias={space_word: 100.0})
    as_written = engine.generate(plain, "hypic", params).text
    assert as_written == texts[space_word] * 3
    assert engine.generate(spaced, "hypic", params).text == as_written[1:]
    deltas, generation = streamed(engine, spaced, params)
    assert "".join(deltas) == generation.text == as_written[1:] and deltas[0] == texts[space_word][1:]
    params = SamplingParams(max_new_tokens=3, logit_bias={word: 100.0})
    assert engine.generate(spaced, "hypic", params).text == engine.generate(plain, "hypic", params).text == texts[word] * 3
