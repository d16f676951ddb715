"""How a request is assembled: its mode, seam window and recompute policy, in one object from the caller to the stack.

An `Assembly` is what every way in (the engine, the scheduler, the pipeline, the service, the integrations) hands
down instead of loose `mode` / `seam_tokens` / `policy` arguments; the engine resolves it against its own defaults
(`Engine.resolve`: the seam window and policy it was built with) into the request plan (`PrefillPlan.assembly`),
and each item of a stack pass carries it to the stack, which reads what the mode asks of the pass
(`reposition_keys`, `composition`: `modes.MODE_TABLE`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hypic_rag.entry.schema import check_seam_tokens
from hypic_rag.runtime.modes import ModeSpec, mode_spec
from hypic_rag.runtime.recompute_policy import as_policy


@dataclass(frozen=True, slots=True)
class Assembly:
    """mode: one of `modes.MODES`; seam_tokens: the seam window of `hypic` chunks (None: the engine's); policy:
    what a `hypic` request recomputes (a `RecomputePolicy`, a spec string, or None: the engine's). Checked on
    construction (`UnknownModeError`, ValueError, `RecomputePolicyError`); a spec string becomes its policy."""

    mode: str = "hypic"
    seam_tokens: int | None = None
    policy: Any = None

    def __post_init__(self) -> None:
        mode_spec(self.mode)
        if self.seam_tokens is not None:
            check_seam_tokens(self.seam_tokens)
        if self.policy is not None:
            object.__setattr__(self, "policy", as_policy(self.policy))

    @classmethod
    def of(cls, assembly: Assembly | str | None = None) -> Assembly:
        """`assembly` itself, the assembly of a mode name, or the default (`hypic`, the engine's seam and policy)."""
        if isinstance(assembly, Assembly):
            return assembly
        return cls() if assembly is None else cls(assembly)

    @property
    def spec(self) -> ModeSpec:
        """The mode's row of the mode table."""
        return mode_spec(self.mode)

    @property
    def reposition_keys(self) -> bool:
        """Cached keys are rotated at their true positions (else left at their standalone positions)."""
        return self.spec.reposition_keys

    @property
    def composition(self) -> str:
        """"transition" (P h + Z per cached span) or "addition" (h + Z)."""
        return self.spec.composition

    def resolved(self, seam_tokens: int, policy: Any) -> Assembly:
        """This assembly with the seam window and policy it leaves open (None) set to the given defaults."""
        return Assembly(
            self.mode,
            check_seam_tokens(seam_tokens) if self.seam_tokens is None else self.seam_tokens,
            policy if self.policy is None else self.policy,
        )
