"""Token mixers on one interface (`base.py`): recurrent mixers (one module per kind: `gated_deltanet.py`, ...) and
attention (`attention.py`)."""

from hypic_rag.runtime.mixers.base import (
    AttentionMixer,
    AttentionProjections,
    Mixer,
    NoPositions,
    Positioner,
    Projections,
    RecurrenceInputs,
    RecurrentMixer,
    TransitionRun,
)

__all__ = [
    "AttentionMixer",
    "AttentionProjections",
    "Mixer",
    "NoPositions",
    "Positioner",
    "Projections",
    "RecurrenceInputs",
    "RecurrentMixer",
    "TransitionRun",
]
