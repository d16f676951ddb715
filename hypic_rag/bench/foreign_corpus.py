"""A small corpus the project's models never saw: 15 invented documents about harbour towns, and a question for
each, written as text files by `write_foreign_corpus` (the server benchmark indexes them; nothing here is from the
bundled model's synthetic world, whose documents are organisations, people and places of another shape)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Harbour:
    town: str
    river: str
    founded: int
    keeper: str
    cargo: str
    lighthouse: str
    festival: str


HARBOURS = (
    Harbour("Quillmouth", "Ostra", 1412, "Marit Oldeby", "salted cod", "the Grey Needle", "the Net Mending Fair"),
    Harbour("Brackenhithe", "Luma", 1530, "Joss Tavener", "slate", "Saint Orrin's Lamp", "the Slate Race"),
    Harbour("Wendle Cove", "Pell", 1288, "Aud Varro", "wool bales", "the Copper Eye", "the Fleece Night"),
    Harbour("Harrowgate Quay", "Sable", 1604, "Ines Kell", "tin ingots", "the Widow's Torch", "the Tin Parade"),
    Harbour("Porth Aneth", "Dwy", 1377, "Cai Morrow", "oysters", "the Low Beacon", "the Shell Supper"),
    Harbour("Saltry", "Brenn", 1455, "Odile Fane", "rock salt", "the White Spire", "the Brine Dance"),
    Harbour("Ketterby", "Isel", 1702, "Rune Aske", "timber", "the Long Glim", "the Log Roll"),
    Harbour("Mossfleet", "Carra", 1519, "Tamsin Reyl", "peat", "the Turf Light", "the Peat Bonfire"),
    Harbour("Old Vennick", "Tarn", 1260, "Bram Ostley", "amber", "the Honey Lamp", "the Amber Walk"),
    Harbour("Culver Stair", "Wyn", 1643, "Nell Harrow", "lime", "the Chalk Flame", "the Lime Kiln Feast"),
    Harbour("Drummock", "Esk", 1398, "Ewan Pryce", "barley", "the Malt Tower", "the Harvest Row"),
    Harbour("Idris Landing", "Avon Fach", 1581, "Sion Gale", "copper ore", "the Red Lantern", "the Ore Bell"),
    Harbour("Farrow Reach", "Lune", 1476, "Greta Holm", "herring", "the Silver Post", "the Herring Moon"),
    Harbour("Tolland", "Kesh", 1334, "Piet Vanne", "glass", "the Clear Candle", "the Glassblowers' Eve"),
    Harbour("Merrow Point", "Ouse Minor", 1689, "Lise Brand", "hemp rope", "the Rope Light", "the Knot Contest"),
)


def document_text(harbour: Harbour) -> str:
    return (
        f"{harbour.town} is a harbour town at the mouth of the river {harbour.river}. It received its charter in "
        f"{harbour.founded}. The harbour master of {harbour.town} is {harbour.keeper}. Most ships leaving "
        f"{harbour.town} carry {harbour.cargo}. The lighthouse that guards its entrance is called "
        f"{harbour.lighthouse}. Every summer the town holds {harbour.festival}."
    )


def questions() -> list[str]:
    """One question per document, in document order."""
    return [f"Who is the harbour master of {harbour.town}?" for harbour in HARBOURS]


def write_foreign_corpus(directory: Path) -> Path:
    """Write the 15 documents as `.txt` files into `directory` (created); returns it."""
    directory.mkdir(parents=True, exist_ok=True)
    for number, harbour in enumerate(HARBOURS):
        slug = harbour.town.lower().replace(" ", "-")
        (directory / f"{number:02d}-{slug}.txt").write_text(document_text(harbour) + "\n", encoding="utf-8")
    return directory
