"""Fixed pools of invented names and plain words for the synthetic QA corpus.

The pools are built once from a fixed seed (independent of any corpus seed), so every corpus, the tokenizer and
the shipped model share one vocabulary of names; a corpus seed only decides which names combine with which facts.
Invented names are syllable strings that are not English words, so the model cannot know facts about them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cache

POOL_SEED = 20261130

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gr", "kr", "st", "th", "tr", "sh", "ch")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "io", "ou")
_CODAS = ("", "", "", "n", "r", "l", "s", "th", "nd", "rk", "x", "m")

PROFESSIONS = (
    "baker", "pilot", "potter", "nurse", "carpenter", "chemist", "architect", "librarian", "farmer", "sculptor",
    "engineer", "jeweller", "surgeon", "tailor", "welder", "botanist", "painter", "plumber", "lawyer", "teacher",
    "astronomer", "brewer", "cartographer", "dentist", "editor", "fisher", "glassblower", "historian", "miner", "violinist",
)
HOBBIES = (
    "chess", "sailing", "gardening", "fencing", "archery", "knitting", "cycling", "birdwatching", "rowing", "climbing",
    "juggling", "origami", "skating", "fishing", "painting", "baking", "hiking", "diving", "poetry", "woodcarving",
)
INDUSTRIES = (
    "shipping", "textiles", "software", "mining", "publishing", "farming", "robotics", "insurance", "brewing",
    "aviation", "pharmacy", "furniture", "printing", "ceramics", "logistics", "banking", "energy", "toys",
)
KNOWN_FOR = (
    "glassworks", "festivals", "bridges", "orchards", "lighthouses", "markets", "gardens", "canals", "museums",
    "vineyards", "castles", "fountains", "libraries", "windmills", "harbours", "theatres", "bakeries", "towers",
)
PRODUCT_CATEGORIES = (
    "kettle", "drone", "bicycle", "lamp", "camera", "telescope", "blender", "scooter", "speaker", "heater",
    "printer", "radio", "tent", "watch", "backpack", "sewing machine", "microscope", "toaster",
)
COLOURS = ("red", "blue", "green", "yellow", "orange", "purple", "black", "white", "grey", "silver", "teal", "brown")
ORGANISATION_SUFFIXES = ("Labs", "Group", "Works", "Systems", "Trading", "Industries", "Company", "Partners")


@dataclass(frozen=True, slots=True)
class NamePools:
    """Disjoint pools of invented capitalised names, one per role."""

    first_names: tuple[str, ...]
    last_names: tuple[str, ...]
    places: tuple[str, ...]
    regions: tuple[str, ...]
    rivers: tuple[str, ...]
    organisation_stems: tuple[str, ...]
    product_stems: tuple[str, ...]

    def all_names(self) -> tuple[str, ...]:
        return (
            self.first_names + self.last_names + self.places + self.regions + self.rivers
            + self.organisation_stems + self.product_stems
        )


def _invent_word(rng: random.Random, syllables: int) -> str:
    parts = []
    for index in range(syllables):
        onset = rng.choice(_ONSETS)
        coda = rng.choice(_CODAS) if index == syllables - 1 else ""
        parts.append(onset + rng.choice(_VOWELS) + coda)
    return "".join(parts).capitalize()


@cache
def name_pools() -> NamePools:
    """The fixed name pools (deterministic; built once per process)."""
    rng = random.Random(POOL_SEED)
    sizes = dict(first_names=160, last_names=160, places=120, regions=40, rivers=40, organisation_stems=120, product_stems=100)
    reserved = {word.capitalize() for word in PROFESSIONS + HOBBIES + INDUSTRIES + KNOWN_FOR + COLOURS}
    used: set[str] = set(reserved)
    pools: dict[str, tuple[str, ...]] = {}
    for role, size in sizes.items():
        names: list[str] = []
        while len(names) < size:
            word = _invent_word(rng, rng.choice((2, 2, 3)))
            if len(word) < 4 or len(word) > 9 or word in used:
                continue
            used.add(word)
            names.append(word)
        pools[role] = tuple(names)
    return NamePools(**pools)
