"""Recompute policies: which tokens of a `hypic` request run through the model, chunk by chunk.

A `hypic` request is a plan of spans (`stack.Span`): the prefix (exact from its seam-0 entry), one span per chunk,
the question (recomputed). A policy decides, per chunk, one of
- a seam window w: its first w tokens are recomputed in context, the rest come from its entry encoded for seam w
  (the suffix pair P, Z of tokens w..L-1, its K/V, its conv tail): what HYPIC and EPIC do;
- whole (`WHOLE`): the chunk is recomputed in context from its first to its last token; no entry is read.
Both are exact compositions of what the cache stores (a whole chunk needs nothing at all), so no policy here
changes the stack pass.

The policies are small classes registered by kind (`register_policy`, `POLICIES`): `SeamPolicy` (`seam`: every
chunk at seam w), `WholePolicy` (`whole:N`: the N highest-ranked chunks whole), `BudgetPolicy` (`budget:X`: whole
chunks in rank order within X times the seam plan's tokens), `TokensPolicy` (`tokens:N`: the same within N tokens).
Each gives its spec word, its amount and its range, its help text, its calibration candidates and which chunks it
recomputes whole (`RecomputePolicy.whole_chunks`); the base parses, prints, checks and plans every kind alike.
A new policy is one class plus `@register_policy` (docs/recompute_policies.md, "Adding a policy").

Any of them may read *anchored* entries (`+anchored`, `anchoring.py`): each chunk's entry encoded after the prompt
prefix instead of alone, so that its cached tokens were computed with the attention sink the real prompt has. That
changes which entries a plan reads (the segment `anchor + chunk` at seam `len(anchor) + w`), not which tokens it
recomputes; the entries hold the anchor's K/V rows too (bytes counted in docs/recompute_policies.md).

The rank of a chunk is `Request.chunk_ranks` (0 = most important; the pipeline ranks direct retrieval hits and
the retrieval hop's hits alternately, see `pipeline.retrieval_ranks`), or prompt order when the request has none.

Specs (CLI `--recompute-policy`, the service's config, the index manifest): `seam`, `seam@16`, `whole:1`,
`whole:2@8`, `budget:2`, `budget:1.5@8`, `tokens:96@0`, `seam@0+anchored`; `@w` sets the seam of the chunks that are
not recomputed whole, `+anchored` makes the plan read anchored entries. Every number of a spec is checked against
its range (`hypic_rag.utils.limits`: W in 0..65536, each kind's amount in its `PolicyAmount.allowed`) when the spec
is parsed, whatever its kind; the error names the number and the range.
`docs/recompute_policies.md` has the measurements that chose among them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar, Protocol, runtime_checkable

from hypic_rag.entry.schema import check_seam_tokens
from hypic_rag.errors import EXIT_BAD_INPUT, HypicError
from hypic_rag.utils.limits import POLICY_BUDGET, POLICY_CHUNKS, POLICY_TOKENS, SEAM_TOKENS, NumberRange

WHOLE = None
"""A chunk recomputed whole: no entry, every token through the model in context."""

DEFAULT_KL_TARGET = 0.002
"""Calibration's default target (`runtime.calibration`, `hypic-rag calibrate`): the mean first-token
KL(full || policy) accepted (docs/recompute_policies.md, "Calibration", says how it was chosen)."""

ANCHORED_SUFFIX = "+anchored"
"""The spec suffix of a policy that reads anchored entries (`anchoring.py`)."""
CHAINED_SUFFIX = "+chained"
"""The spec suffix of a policy that reads chained entries (`anchoring.chained_anchor`): a chunk that follows its
document's previous chunk in the prompt reads the entry encoded after that chunk; the others read anchored ones."""

_SPEC = re.compile(
    r"^(?P<kind>[a-z]+)(?::(?P<amount>[0-9]+(?:\.[0-9]+)?))?(?:@(?P<seam>[0-9]+))?(?P<anchored>\+anchored|\+chained)?$"
)


class RecomputePolicyError(HypicError, ValueError):
    """A recompute policy spec or setting that is not valid (exit code 2; still a ValueError)."""

    exit_code = EXIT_BAD_INPUT


@dataclass(frozen=True, slots=True)
class RecomputePlan:
    """What one request recomputes: per chunk, the seam window of its entry or `WHOLE` (None).

    chunk_seams[i] = w: chunk i recomputes its first min(w, L_i) tokens and reads the rest from its seam-w entry;
    None: chunk i is recomputed whole and reads no entry.
    """

    chunk_seams: tuple[int | None, ...]

    def recomputed_chunk_tokens(self, chunk_lengths: Sequence[int]) -> int:
        """Chunk tokens this plan runs through the model (prefix and question excluded)."""
        if len(chunk_lengths) != len(self.chunk_seams):
            raise ValueError(f"{len(chunk_lengths)} chunk lengths for a plan of {len(self.chunk_seams)} chunks")
        return sum(length if seam is WHOLE else min(seam, length) for seam, length in zip(self.chunk_seams, chunk_lengths))

    @property
    def whole_chunks(self) -> list[int]:
        """Indices of the chunks recomputed whole."""
        return [number for number, seam in enumerate(self.chunk_seams) if seam is WHOLE]

    def normalised(self, chunk_lengths: Sequence[int]) -> RecomputePlan:
        """This plan with a seam at least as long as its chunk written as `WHOLE`: the same tokens recomputed, and
        no entry of that seam read (or encoded and stored) for nothing. What is cached depends on the plan, not on
        how a policy spelled it: `seam@100000` stores no entry at all."""
        if len(chunk_lengths) != len(self.chunk_seams):
            raise ValueError(f"{len(chunk_lengths)} chunk lengths for a plan of {len(self.chunk_seams)} chunks")
        return RecomputePlan(tuple(WHOLE if seam is not WHOLE and seam >= length > 0 else seam
                                   for seam, length in zip(self.chunk_seams, chunk_lengths)))


@dataclass(frozen=True)
class PolicyAmount:
    """The number of a spec `kind:AMOUNT`: the policy field it fills, its range (`hypic_rag.utils.limits`), its
    letter in the spec forms (N, X) and what it counts, for error messages."""

    field: str
    allowed: NumberRange
    letter: str = "N"
    noun: str = "amount"


POLICIES: dict[str, type[RecomputePolicy]] = {}
"""The registered policy classes by kind, in registration order (the order of the spec forms in help texts)."""

_KIND = re.compile(r"[a-z]+")


def register_policy(policy_class: type[RecomputePolicy]) -> type[RecomputePolicy]:
    """Register `policy_class` under its `kind` (a class decorator): specs of that kind parse to it, the help texts
    and error messages name its form, and `hypic-rag calibrate` compares its `candidates`."""
    kind = getattr(policy_class, "kind", "")
    if not (isinstance(kind, str) and _KIND.fullmatch(kind)):
        raise ValueError(f"a recompute policy kind is lower-case letters, got {kind!r}")
    if kind in POLICIES and POLICIES[kind] is not policy_class:
        raise ValueError(f"recompute policy {kind!r} is registered already ({POLICIES[kind].__name__})")
    amount = policy_class.amount
    if amount is not None and amount.field not in {item.name for item in fields(policy_class)}:
        raise ValueError(f"{policy_class.__name__} has no field {amount.field!r} for its amount")
    POLICIES[kind] = policy_class
    return policy_class


def spec_help() -> str:
    """The spec forms of every registered policy, for error messages ("seam, seam@W, whole:N[@W], ...")."""
    return f"{', '.join(policy.form for policy in POLICIES.values())}, each optionally {ANCHORED_SUFFIX} or {CHAINED_SUFFIX}"


def policy_help() -> str:
    """The spec forms with what each recomputes, for the CLI's and the service's help texts."""
    forms = ", ".join(f"{policy.form} ({policy.meaning})" if policy.meaning else policy.form
                      for policy in POLICIES.values())
    return f"{forms}; each optionally {ANCHORED_SUFFIX} (entries encoded after the prompt prefix) or {CHAINED_SUFFIX}"


def calibration_candidates() -> tuple[RecomputePolicy, ...]:
    """What `hypic-rag calibrate` compares unless told: every registered policy's `candidates`, by position."""
    listed = sorted((position, number, spec) for number, policy in enumerate(POLICIES.values())
                    for position, spec in policy.candidates)
    return tuple(RecomputePolicy.parse(spec) for _, _, spec in listed)


@dataclass(frozen=True, slots=True, kw_only=True)
class RecomputePolicy:
    """A rule that turns a request's chunks into a `RecomputePlan` (see the module docstring); the base of the
    registered policy classes (`register_policy`), one per kind.

    seam_tokens: the seam of the chunks not recomputed whole; None: the engine's (the index's) seam.
    anchored: the chunks not recomputed whole read anchored entries (encoded after the prompt prefix,
    `anchoring.py`) instead of standalone ones.
    chained: anchored, and a chunk that follows its document's previous chunk in the prompt (`Request.chunk_follows`)
    reads the entry encoded after the anchor and that chunk (`anchoring.chained_anchor`). Implies `anchored`.

    A policy class gives its `kind` (the spec's word), `form` and `meaning` (help texts), `amount` (the number of
    `kind:AMOUNT`, None for a kind that takes none), `candidates` ((position, spec) pairs `hypic-rag calibrate`
    compares by default, listed by position: of equal cost and KL the earlier wins) and `whole_chunks`.
    """

    kind: ClassVar[str] = ""
    form: ClassVar[str] = ""
    meaning: ClassVar[str] = ""
    amount: ClassVar[PolicyAmount | None] = None
    candidates: ClassVar[tuple[tuple[float, str], ...]] = ()

    seam_tokens: int | None = None
    anchored: bool = False
    chained: bool = False

    def __post_init__(self) -> None:
        if POLICIES.get(self.kind) is not type(self):
            raise RecomputePolicyError(f"{type(self).__name__} is not a registered recompute policy; choose one of: "
                                       f"{spec_help()}")
        if self.seam_tokens is not None:
            _check_number(SEAM_TOKENS, self.seam_tokens, "a recompute policy's seam (@W)")
        if self.amount is not None:
            value = getattr(self, self.amount.field)
            _check_number(self.amount.allowed, value, f"a recompute policy's {self.amount.noun}")
            if not self.amount.allowed.integer:
                object.__setattr__(self, self.amount.field, float(value))
        if not isinstance(self.anchored, bool):
            raise RecomputePolicyError(f"a recompute policy's anchored flag must be a bool, got {self.anchored!r}")
        if not isinstance(self.chained, bool):
            raise RecomputePolicyError(f"a recompute policy's chained flag must be a bool, got {self.chained!r}")
        if self.chained:
            object.__setattr__(self, "anchored", True)

    # ------------------------------------------------------------------------------------------------ specs
    @classmethod
    def parse(cls, spec: str) -> RecomputePolicy:
        """The policy of a spec (`seam`, `seam@16`, `whole:1`, `whole:2@8`, `budget:2`, `budget:1.5@8`,
        `seam@0+anchored`); `RecomputePolicyError` naming the forms for anything else."""
        match = _SPEC.match(spec.strip()) if isinstance(spec, str) else None
        if match is None:
            raise RecomputePolicyError(f"not a recompute policy: {_shown_spec(spec)}; expected one of: {spec_help()}")
        kind, amount, seam = match.group("kind"), match.group("amount"), match.group("seam")
        policy_class = POLICIES.get(kind)
        if policy_class is None:
            raise RecomputePolicyError(f"unknown recompute policy {kind!r}; expected one of: {spec_help()}")
        # every number of a spec is checked against its range here, before any is used (whatever the kind)
        seam_tokens = None if seam is None else _parse_number(SEAM_TOKENS, seam, "the seam (@W)", spec)
        suffix = match.group("anchored")
        settings: dict[str, Any] = {"seam_tokens": seam_tokens, "anchored": suffix is not None,
                                    "chained": suffix == CHAINED_SUFFIX}
        wanted = policy_class.amount
        if wanted is None:
            if amount is not None:
                raise RecomputePolicyError(f"policy {kind} takes no amount ({kind} or {kind}@W), got {spec!r}")
            return policy_class(**settings)
        if amount is None:
            raise RecomputePolicyError(f"policy {kind} needs an amount ({kind}:N), got {spec!r}")
        if wanted.allowed.integer and "." in amount:
            raise RecomputePolicyError(f"policy {kind} takes a whole number, got {spec!r}")
        settings[wanted.field] = _parse_number(wanted.allowed, amount, f"{wanted.letter} of {kind}:{wanted.letter}",
                                               spec)
        return policy_class(**settings)

    @property
    def spec(self) -> str:
        """The spec `parse` reads back into this policy."""
        text = self.kind
        if self.amount is not None:
            value = getattr(self, self.amount.field)
            text += f":{value}" if self.amount.allowed.integer else f":{value:g}"
        if self.seam_tokens is not None:
            text += f"@{self.seam_tokens}"
        if self.anchored:
            text += CHAINED_SUFFIX if self.chained else ANCHORED_SUFFIX
        return text

    def __str__(self) -> str:
        return self.spec

    # ------------------------------------------------------------------------------------------------ plans
    def chunk_seam(self, default_seam: int) -> int:
        """The seam window of the chunks this policy does not recompute whole."""
        return check_seam_tokens(default_seam if self.seam_tokens is None else self.seam_tokens)

    def whole_chunks(self, order: Sequence[int], chunk_lengths: Sequence[int], seam: int) -> Iterable[int]:
        """The chunks this policy recomputes whole: numbers into `chunk_lengths` [n], given all n of them most
        important first (`order`) and the seam `seam` of the others. The base recomputes none."""
        return ()

    def plan(self, chunk_lengths: Sequence[int], default_seam: int, ranks: Sequence[int] = ()) -> RecomputePlan:
        """The plan for chunks of `chunk_lengths` [n] ranked by `ranks` [n] (lower = more important; ties and an
        empty `ranks` in prompt order); chunks not recomputed whole get the policy's seam (`default_seam` unless
        the policy names its own)."""
        seam = self.chunk_seam(default_seam)
        count = len(chunk_lengths)
        if ranks and len(ranks) != count:
            raise ValueError(f"{len(ranks)} ranks for {count} chunks")
        seams: list[int | None] = [seam] * count
        order = sorted(range(count), key=lambda number: (ranks[number] if ranks else 0, number))
        for number in self.whole_chunks(order, chunk_lengths, seam):
            seams[number] = WHOLE
        return RecomputePlan(tuple(seams))

    def resolved(self, default_seam: int) -> RecomputePolicy:
        """This policy with its seam made explicit (`default_seam` unless it names one)."""
        return replace(self, seam_tokens=self.chunk_seam(default_seam))

    def entry_seams(self, default_seam: int) -> set[int]:
        """The chunk seams the plans of this policy read (an anchored entry's own seam adds the anchor's length:
        `anchoring.anchored_key`)."""
        return {self.chunk_seam(default_seam)}

    # ------------------------------------------------------------------------------------------------ records
    def to_dict(self) -> dict[str, Any]:
        return {"spec": self.spec}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RecomputePolicy:
        if not isinstance(data, dict) or not isinstance(data.get("spec"), str):
            raise RecomputePolicyError(f"a recorded recompute policy must be an object with a spec, got {data!r}")
        return cls.parse(data["spec"])


def whole_within(order: Sequence[int], chunk_lengths: Sequence[int], seam: int, allowed: float) -> list[int]:
    """Chunks recomputed whole in `order` while the chunk tokens recomputed (every chunk's seam counted from the
    start) stay within `allowed`; a chunk that does not fit is skipped and the next one tried."""
    spent = sum(min(seam, length) for length in chunk_lengths)
    chosen = []
    for number in order:
        extra = chunk_lengths[number] - min(seam, chunk_lengths[number])
        if extra and spent + extra <= allowed + 1e-9:
            chosen.append(number)
            spent += extra
    return chosen


# ---------------------------------------------------------------------------------------------------- policies
@register_policy
@dataclass(frozen=True, slots=True, kw_only=True)
class SeamPolicy(RecomputePolicy):
    """`seam`, `seam@W`: every chunk at seam W (the engine's, the index's, unless the spec names one)."""

    kind: ClassVar[str] = "seam"
    form: ClassVar[str] = "seam, seam@W"
    candidates: ClassVar[tuple[tuple[float, str], ...]] = (
        (0, "seam"), (8, "seam@0+anchored"), (9, "seam@0+chained"), (10, "seam+anchored"), (11, "seam+chained"))


@register_policy
@dataclass(frozen=True, slots=True, kw_only=True)
class WholePolicy(RecomputePolicy):
    """`whole:N[@W]`: the `chunks` highest-ranked chunks recomputed whole, seam W for the rest."""

    kind: ClassVar[str] = "whole"
    form: ClassVar[str] = "whole:N[@W]"
    meaning: ClassVar[str] = "the N top-ranked chunks whole, seam W for the rest"
    amount: ClassVar[PolicyAmount | None] = PolicyAmount("chunks", POLICY_CHUNKS, "N", "chunk count")
    candidates: ClassVar[tuple[tuple[float, str], ...]] = ((2, "whole:1"), (4, "whole:2"), (6, "whole:3"),
                                                           (7, "whole:4"))

    chunks: int

    def whole_chunks(self, order: Sequence[int], chunk_lengths: Sequence[int], seam: int) -> Iterable[int]:
        return order[: self.chunks]


@register_policy
@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetPolicy(RecomputePolicy):
    """`budget:X[@W]`: chunks recomputed whole in rank order while the chunk tokens recomputed stay within `budget`
    times those of the seam plan (scale-free: the same spec costs at most that factor whatever the chunk length),
    seam W for the rest; a chunk that does not fit is skipped and the next one tried."""

    kind: ClassVar[str] = "budget"
    form: ClassVar[str] = "budget:X[@W]"
    meaning: ClassVar[str] = "whole chunks while at most X times the seam's tokens"
    amount: ClassVar[PolicyAmount | None] = PolicyAmount("budget", POLICY_BUDGET, "X", "budget")
    candidates: ClassVar[tuple[tuple[float, str], ...]] = (
        (1, "budget:1.5"), (3, "budget:2"), (5, "budget:3"), (11.5, "budget:1.5+anchored"),
        (11.6, "budget:1.5+chained"), (12, "budget:2+anchored"), (13, "budget:2+chained"), (14, "budget:3+anchored"),
        (14.5, "budget:3+chained"))

    budget: float

    def whole_chunks(self, order: Sequence[int], chunk_lengths: Sequence[int], seam: int) -> Iterable[int]:
        return whole_within(order, chunk_lengths, seam, self.budget * sum(min(seam, n) for n in chunk_lengths))


@register_policy
@dataclass(frozen=True, slots=True, kw_only=True)
class TokensPolicy(RecomputePolicy):
    """`tokens:N[@W]`: as `budget` with an absolute budget: at most `tokens` chunk tokens recomputed per request,
    seams included (a request whose seams alone exceed it keeps its seams)."""

    kind: ClassVar[str] = "tokens"
    form: ClassVar[str] = "tokens:N[@W]"
    meaning: ClassVar[str] = "whole chunks while at most N chunk tokens"
    amount: ClassVar[PolicyAmount | None] = PolicyAmount("tokens", POLICY_TOKENS, "N", "token budget")

    tokens: int

    def whole_chunks(self, order: Sequence[int], chunk_lengths: Sequence[int], seam: int) -> Iterable[int]:
        return whole_within(order, chunk_lengths, seam, float(self.tokens))


def _shown_spec(spec: object) -> str:
    """A spec as an error message quotes it (a long one cut)."""
    text = repr(spec)
    return text if len(text) <= 80 else f"{text[:77]}..."


def _check_number(allowed: NumberRange, value: object, name: str) -> None:
    """RecomputePolicyError naming `name` and the range when `value` lies outside `allowed`."""
    problem = allowed.problem(value)
    if problem is not None:
        raise RecomputePolicyError(f"{name} {problem}")


def _parse_number(allowed: NumberRange, text: str, name: str, spec: str) -> Any:
    """The number `text` of a spec, checked against `allowed`; RecomputePolicyError naming it and the range."""
    try:
        return allowed.parse(text)
    except ValueError as error:
        raise RecomputePolicyError(f"in recompute policy {_shown_spec(spec)}: {name} {error}") from None


SEAM_POLICY: RecomputePolicy = SeamPolicy()
"""Today's fixed seam at the engine's (the index's) seam width: the default."""


@runtime_checkable
class PlansChunks(Protocol):
    """Anything that plans a request's chunks as `RecomputePolicy.plan` does (a study's custom rule)."""

    def plan(self, chunk_lengths: Sequence[int], default_seam: int, ranks: Sequence[int] = ()) -> RecomputePlan: ...


def as_policy(policy: RecomputePolicy | PlansChunks | str | None) -> RecomputePolicy | PlansChunks | None:
    """A policy from a `RecomputePolicy` (or any object with its `plan`), a spec string, or None (kept None)."""
    if policy is None or isinstance(policy, (RecomputePolicy, PlansChunks)):
        return policy
    if not isinstance(policy, str):
        raise RecomputePolicyError(f"a recompute policy must be a spec string, got {type(policy).__name__}")
    return RecomputePolicy.parse(policy)
