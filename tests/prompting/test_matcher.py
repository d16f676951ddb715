"""The segment matcher against its references (hashed windows vs direct sums, occurrences vs `str.find`,
selection vs brute force) on random texts, and prompts cut around chunks with the tiny model's real tokenizer:
repeated, overlapping, partial and whitespace-changed chunks, explicit separators, the query and the prefix."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import numpy as np
import pytest

from hypic_rag.prompting.layout import DEFAULT_PROMPT_FORMAT, tokenize_segment
from hypic_rag.prompting.matching import (
    MatchSettings,
    Occurrence,
    Piece,
    SegmentMatcher,
    segment_prompt,
    select_occurrences,
    separated_pieces,
)
from hypic_rag.prompting.matching.naive import occurrences_naive
from hypic_rag.prompting.matching.normalise import NormalisedText, collapse_whitespace
from hypic_rag.prompting.matching.rolling import text_codes, window_hash, window_hashes
from hypic_rag.prompting.segments import segmented_request

FMT = DEFAULT_PROMPT_FORMAT
CHESS = ("The Westbrook Chess Club meets every Thursday in the old library. Its champion, Elena Ruiz, has won "
         "the regional tournament four times.")
BIKES = ("Dmitri Volkov repairs vintage bicycles in a workshop in Harrow Cove. He rebuilt his first racing frame "
         "when he was twelve.")
GLASS = ("Alice Marlow is a glassblower who lives in Pellington. She founded the Amber Kiln studio in 1998 and "
         "teaches evening classes there.")


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def matcher_of(*texts: str, **settings) -> SegmentMatcher:
    matcher = SegmentMatcher(MatchSettings(**settings))
    for text in texts:
        matcher.add_chunk(text, FMT.chunk(text))
    return matcher


def cut(tokenizer, matcher: SegmentMatcher | None, prompt: str, prefix: str = ""):
    return segment_prompt(tokenizer, separated_pieces(prompt.split("<<PIC_SEP>>")), matcher=matcher, prefix=prefix)


# ------------------------------------------------------------------------------------------------ references
@pytest.mark.parametrize("seed", range(4))
def test_window_hashes_equal_the_direct_sum(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "ab \n\u00e9\u4e2d\U0001f600"
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
    for width in (1, 2, 5, 17):
        fast = window_hashes(text_codes(text), width)
        assert fast.dtype == np.uint64 and len(fast) == max(0, len(text) - width + 1)
        assert [int(value) for value in fast] == [window_hash(text[i : i + width]) for i in range(len(fast))]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("collapse", [True, False])
def test_occurrences_equal_the_naive_search(seed: int, collapse: bool) -> None:
    rng = random.Random(seed)
    words = ["ab", "ba", "a", "b", "abba", "x_1"]
    spaces = [" ", "  ", "\n", " \n\t"]

    def text(length: int) -> str:
        return "".join(rng.choice(words) + rng.choice(spaces) for _ in range(length))

    corpus = text(80)
    matcher = SegmentMatcher(MatchSettings(min_chars=6, collapse_whitespace=collapse))
    for _ in range(25):  # substrings of one text: many overlaps and shared anchors
        start = rng.randrange(len(corpus) - 10)
        matcher.add_chunk(corpus[start : start + rng.randint(6, 40)], corpus[start : start + 60])
    prompt = corpus if seed % 2 else text(60) + corpus[rng.randrange(40) :]
    normalised = matcher.normalised(prompt)
    keys = [known.key for known in matcher._known.values()]
    assert sorted(matcher.occurrences(normalised), key=repr) == sorted(occurrences_naive(normalised.text, keys),
                                                                       key=repr)
    chosen = matcher.find(prompt)
    assert all(a.end <= b.start for a, b in itertools.pairwise(chosen))
    for match in chosen:  # each match's span of the prompt is its core, up to whitespace
        found = prompt[match.start : match.end]
        assert (collapse_whitespace(found) if collapse else found) == match.known.key
        assert match.exact == (found == match.known.core)


@pytest.mark.parametrize("seed", range(30))
def test_selection_covers_as_much_as_any_non_overlapping_subset(seed: int) -> None:
    rng = random.Random(seed)
    items = []
    for number in range(rng.randint(0, 9)):
        start = rng.randrange(40)
        items.append(Occurrence(start, start + rng.randint(1, 15), f"k{number}"))
    chosen = select_occurrences(items)
    assert all(a.end <= b.start for a, b in itertools.pairwise(chosen))
    best = max(sum(o.end - o.start for o in subset)
               for size in range(len(items) + 1) for subset in itertools.combinations(items, size)
               if all(a.end <= b.start for a, b in itertools.pairwise(sorted(subset, key=lambda o: o.start))))
    assert sum(o.end - o.start for o in chosen) == best


@pytest.mark.parametrize("seed", range(6))
def test_normalised_spans_map_back_to_the_original(seed: int) -> None:
    rng = random.Random(seed)
    original = "".join(rng.choice(["word", "x", ".", "é"]) + rng.choice([" ", "\n\n", "\t ", ""]) for _ in range(40))
    normalised = NormalisedText(original)
    assert normalised.text == collapse_whitespace(original)
    bounds = [i for i, c in enumerate(normalised.text) if not c.isspace()]
    for _ in range(50):
        start, last = sorted(rng.sample(bounds, 2))
        begin, end = normalised.original_span(start, last + 1)
        assert collapse_whitespace(original[begin:end]) == normalised.text[start : last + 1]
        assert not original[begin].isspace() and not original[end - 1].isspace()


# ------------------------------------------------------------------------------------------------ cutting
def test_a_prompt_is_cut_at_chunk_boundaries_as_the_separated_path_would(tokenizer) -> None:
    matcher = matcher_of(CHESS, BIKES, GLASS)
    prompt = (f"Context information is below.\nfile_name: chess.md\n\n{CHESS}\n\nfile_name: bicycles.md\n\n{BIKES}"
              "\n---\nQuery: Who is the champion?\nAnswer: ")
    segmented = cut(tokenizer, matcher, prompt)
    assert segmented.texts == ("Context information is below.\nfile_name: chess.md\n\n", CHESS + "\n",
                               "\nfile_name: bicycles.md\n\n", BIKES + "\n",
                               "---\nQuery: Who is the champion?\nAnswer: ")
    assert "".join(segmented.texts) == prompt and segmented.matched == (False, True, False, True)
    chunk_ids = [tokenize_segment(tokenizer, FMT.chunk(text)) for text in (CHESS, BIKES)]
    assert [segmented.request.chunk_ids[1], segmented.request.chunk_ids[3]] == chunk_ids  # the cached keys
    assert segmented.matched_tokens == sum(map(len, chunk_ids))
    separated = segmented_request(tokenizer, segmented.separated("<<PIC_SEP>>").split("<<PIC_SEP>>"))
    assert separated == segmented.request


def test_a_chunk_appearing_twice_is_matched_twice(tokenizer) -> None:
    segmented = cut(tokenizer, matcher_of(CHESS), f"Notes:\n{CHESS}\nAgain:\n{CHESS}\nWho won?")
    assert segmented.matched == (False, True, False, True)
    assert segmented.request.chunk_ids[1] == segmented.request.chunk_ids[3] == tokenize_segment(tokenizer, CHESS + "\n")


def test_overlapping_candidates_keep_the_longest_cover(tokenizer) -> None:
    first, second, third = CHESS.split(". ")[0] + ".", CHESS.split(". ")[1], BIKES
    matcher = matcher_of(f"{first} {second}", f"{second}\n{third}")  # two chunks sharing `second`
    prompt = f"Read: {first} {second}\n{third}\nQuestion?"
    matches = matcher.find(prompt)
    assert len(matcher.occurrences(matcher.normalised(prompt))) == 2 and len(matches) == 1
    assert matches[0].known.core == f"{second}\n{third}"  # the longer of the two overlapping occurrences
    segmented = cut(tokenizer, matcher, prompt)
    assert segmented.texts == (f"Read: {first} ", f"{second}\n{third}\n", "Question?")


def test_partial_chunk_text_and_text_inside_a_word_are_not_matched(tokenizer) -> None:
    matcher = matcher_of(CHESS)
    partial = f"Context: {CHESS[: len(CHESS) * 4 // 5]}\nWho?"
    assert matcher.find(partial) == []
    glued = f"Context: xx{CHESS}\nWho?"  # starts inside a word of the prompt
    assert matcher.find(glued) == []
    plain = segmented_request(tokenizer, [partial])
    assert cut(tokenizer, matcher, partial).request == plain and cut(tokenizer, matcher, partial).matched == ()


def test_text_differing_only_in_whitespace_stands_for_the_indexed_chunk(tokenizer) -> None:
    reflowed = CHESS.replace(". ", ".\n  ").replace(" the ", "  the\t")
    prompt = f"Context:\n{reflowed}\nWho is the champion?"
    segmented = cut(tokenizer, matcher_of(CHESS), prompt)
    assert segmented.matched == (False, True)
    assert segmented.texts[1] == CHESS + "\n"  # the indexed text, so its cached entry is used
    assert segmented.request.chunk_ids[1] == tokenize_segment(tokenizer, FMT.chunk(CHESS))
    exact_only = matcher_of(CHESS, collapse_whitespace=False)
    assert exact_only.find(prompt) == [] and len(exact_only.find(f"Context:\n{CHESS}\nWho?")) == 1


def test_a_prompt_without_matches_is_cut_only_at_its_separators(tokenizer) -> None:
    matcher = matcher_of(CHESS, BIKES)
    for prompt in ("Who keeps bees on the hill above the village of Carrow, and why?",
                   f"{GLASS}<<PIC_SEP>>Who founded the studio?"):
        segmented = cut(tokenizer, matcher, prompt, FMT.prefix)
        assert segmented.request == segmented_request(tokenizer, prompt.split("<<PIC_SEP>>"))
        assert segmented.matched_segments == 0


def test_explicit_separators_take_precedence_and_their_segments_are_remembered(tokenizer) -> None:
    matcher = matcher_of(CHESS)
    prompt = f"Intro {CHESS} outro<<PIC_SEP>>{GLASS}\n<<PIC_SEP>>Who?"
    segmented = cut(tokenizer, matcher, prompt)
    assert segmented.texts == (f"Intro {CHESS} outro", GLASS + "\n", "Who?") and segmented.matched_segments == 0
    # the explicit segments are now known: the same text pasted without separators is found
    again = cut(tokenizer, matcher, f"Docs: {GLASS}\nWho founded it?")
    assert again.texts == ("Docs: ", GLASS + "\n", "Who founded it?") and again.matched == (False, True)
    assert matcher.counts() == {"index": 1, "seen": 2}


def test_matching_never_cuts_a_prompt_into_more_segments_than_allowed(tokenizer) -> None:
    prompt = f"Docs:\n{CHESS}\n{BIKES}\nWho won?"
    assert len(cut(tokenizer, matcher_of(CHESS, BIKES, max_segments=4), prompt).texts) == 4
    limited = cut(tokenizer, matcher_of(CHESS, BIKES, max_segments=3), prompt)
    assert limited.matched_segments == 0 and limited.request == segmented_request(tokenizer, [prompt])


def test_a_chunk_with_nothing_after_it_stays_in_the_query(tokenizer) -> None:
    segmented = cut(tokenizer, matcher_of(CHESS, BIKES), f"Summarise:\n{BIKES}\n{CHESS}\n")
    assert segmented.texts == ("Summarise:\n", BIKES + "\n", CHESS + "\n") and segmented.matched == (False, True)
    with pytest.raises(ValueError, match="query"):
        cut(tokenizer, matcher_of(CHESS), "x<<PIC_SEP>>")


def test_the_prompt_prefix_becomes_the_prefix_segment_when_chunks_are_found(tokenizer) -> None:
    prompt = FMT.prefix + FMT.chunk(CHESS) + FMT.chunk(BIKES) + FMT.question("Who won?")
    segmented = cut(tokenizer, matcher_of(CHESS, BIKES), prompt, FMT.prefix)
    rag = [tokenize_segment(tokenizer, FMT.chunk(text)) for text in (CHESS, BIKES)]
    assert segmented.request.prefix_ids == tokenize_segment(tokenizer, FMT.prefix)
    assert segmented.request.chunk_ids == rag  # the RAG layout of /v1/ask and HypicQueryEngine
    assert segmented.request.question_ids == tokenize_segment(tokenizer, FMT.question("Who won?"))
    assert segmented.matched == (False, True, True)
    separated = segmented_request(tokenizer, segmented.separated("|").split("|"), FMT.prefix)
    assert separated == segmented.request
    unmatched = cut(tokenizer, matcher_of(GLASS), prompt, FMT.prefix)  # nothing found: nothing cut
    assert unmatched.request.prefix_ids == [] and unmatched.request.chunk_ids == []


def test_short_texts_are_not_known_and_seen_segments_are_bounded() -> None:
    matcher = SegmentMatcher(MatchSettings(min_chars=64, seen_capacity=2))
    assert not matcher.add_chunk("A short chunk.", "A short chunk.\n")
    for text in (CHESS, BIKES, GLASS):
        assert matcher.add_seen(text + "\n")
    assert matcher.counts() == {"index": 0, "seen": 2} and matcher.find(f"x {CHESS} y") == []  # the oldest went
    matcher.add_chunk(BIKES, BIKES + "\n")  # an indexed chunk replaces the seen copy and is never forgotten
    for number in range(3):
        matcher.add_seen(f"{GLASS} Note {number}.")
    assert matcher.counts() == {"index": 1, "seen": 2} and len(matcher.find(f"x {BIKES} y")) == 1
    assert not SegmentMatcher(MatchSettings(enabled=False)).add_seen(CHESS)
    with pytest.raises(ValueError):
        MatchSettings(min_chars=0)


def test_thousands_of_known_chunks_are_found_in_a_long_prompt() -> None:
    rng = random.Random(0)
    words = [f"w{number}" for number in range(500)]
    chunks = [" ".join(rng.choice(words) for _ in range(40)) for _ in range(2000)]
    matcher = SegmentMatcher()
    for text in chunks:
        matcher.add_chunk(text, text + "\n")
    prompt = "\n\n".join(chunks[:: 97]) + "\nQuestion?"
    found = matcher.find(prompt)
    assert [match.known.core for match in found] == chunks[:: 97]


def test_the_prefill_reports_each_segments_reused_tokens(tiny_model: Path) -> None:
    from hypic_rag.pipeline.session import ModelSession

    with ModelSession.open(tiny_model, device="cpu", seam_tokens=4) as session:
        request = session.request("Who won?", [session.chunk_ids(CHESS), session.chunk_ids(BIKES)])
        first = session.engine.prefill(request, "hypic").stats
        assert first.segment_reused_tokens == [0, 0, 0] and first.cached_tokens == 0
        second = session.engine.prefill(request, "hypic").stats
        lengths = [len(segment) for segment in request.segments]
        assert second.segment_reused_tokens == [lengths[0], lengths[1] - 4, lengths[2] - 4]  # prefix: seam 0
        assert sum(second.segment_reused_tokens) == second.cached_tokens
        assert session.engine.prefill(request, "full").stats.segment_reused_tokens == [0, 0, 0]
