"""Recompute policies: which tokens of a `hypic` request run through the model, chunk by chunk.

A `hypic` request is a plan of spans (`stack.Span`): the prefix (exact from its seam-0 entry), one span per chunk,
the question (recomputed). A policy decides, per chunk, one of
- a seam window w: its first w tokens are recomputed in context, the rest come from its entry encoded for seam w
  (the suffix pair P, Z of tokens w..L-1, its K/V, its conv tail): what HYPIC and EPIC do;
- whole (`WHOLE`): the chunk is recomputed in context from its first to its last token; no entry is read.
Both are exact compositions of what the cache stores (a whole chunk needs nothing at all), so no policy here
changes the stack pass.

The policies (`RecomputePolicy.kind`):
- `seam`: every chunk seam w (today's fixed seam; w = the index's seam unless the spec says another).
- `whole`: the `chunks` highest-ranked chunks recomputed whole, seam w for the rest.
- `budget`: chunks recomputed whole in rank order while the chunk tokens recomputed stay within `budget` times
  those of the seam plan (scale-free: the same spec costs at most that factor whatever the chunk length), seam w
  for the rest. A chunk that does not fit is skipped and the next one tried.
- `tokens`: the same with an absolute budget: at most `tokens` chunk tokens recomputed per request, seams
  included (a request whose seams alone exceed it keeps its seams).

Any of them may read *anchored* entries (`+anchored`, `anchoring.py`): each chunk's entry encoded after the prompt
prefix instead of alone, so that its cached tokens were computed with the attention sink the real prompt has. That
changes which entries a plan reads (the segment `anchor + chunk` at seam `len(anchor) + w`), not which tokens it
recomputes; the entries hold the anchor's K/V rows too (bytes counted in docs/recompute_policies.md).

The rank of a chunk is `Request.chunk_ranks` (0 = most important; the pipeline ranks direct retrieval hits and
the retrieval hop's hits alternately, see `pipeline.retrieval_ranks`), or prompt order when the request has none.

Specs (CLI `--recompute-policy`, the service's config, the index manifest): `seam`, `seam@16`, `whole:1`,
`whole:2@8`, `budget:2`, `budget:1.5@8`, `tokens:96@0`, `seam@0+anchored`; `@w` sets the seam of the chunks that are
not recomputed whole, `+anchored` makes the plan read anchored entries. Every number of a spec is checked against
its range (`hypic_rag.utils.limits`) when the spec is parsed, whatever its kind: W in 0..65536, whole:N in 1..4096,
budget:X in 1..10000, tokens:N in 1..16777216; the error names the number and the range.
`docs/recompute_policies.md` has the measurements that chose among them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from hypic_rag.entry.schema import check_seam_tokens
from hypic_rag.errors import EXIT_BAD_INPUT, HypicError
from hypic_rag.utils.limits import POLICY_BUDGET, POLICY_CHUNKS, POLICY_TOKENS, SEAM_TOKENS, NumberRange

WHOLE = None
"""A chunk recomputed whole: no entry, every token through the model in context."""

POLICY_KINDS = ("seam", "whole", "budget", "tokens")
SPEC_HELP = "seam, seam@W, whole:N[@W], budget:X[@W], tokens:N[@W], each optionally +anchored or +chained"
"""The spec forms, for help texts and error messages."""

DEFAULT_KL_TARGET = 0.002
"""Calibration's default target (`runtime.calibration`, `hypic-rag calibrate`): the mean first-token
KL(full || policy) accepted. Chosen on the calibration worlds (950,000,000+) and judged on development worlds
(docs/recompute_policies.md): on both test-bed models the policies whose calibration KL was at most 0.002 came within
half a point of `full`'s exact match, while those at 0.003-0.005 (anchored entries without a recomputed chunk) lost
about a point on the model never trained for composition, and the fixed seam (KL 0.5-0.8 there) 14 points. The
earlier default, 0.1, dates from before anchored entries, when no cheap policy came below it."""

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


@dataclass(frozen=True, slots=True)
class RecomputePolicy:
    """A rule that turns a request's chunks into a `RecomputePlan` (see the module docstring).

    kind: "seam", "whole", "budget" or "tokens". chunks: for "whole", how many top-ranked chunks are recomputed
    whole. budget: for "budget", the most chunk tokens recomputed, as a multiple (>= 1) of the seam plan's.
    tokens: for "tokens", the most chunk tokens recomputed per request.
    seam_tokens: the seam of the chunks not recomputed whole; None: the engine's (the index's) seam.
    anchored: the chunks not recomputed whole read anchored entries (encoded after the prompt prefix,
    `anchoring.py`) instead of standalone ones.
    chained: anchored, and a chunk that follows its document's previous chunk in the prompt (`Request.chunk_follows`)
    reads the entry encoded after the anchor and that chunk (`anchoring.chained_anchor`). Implies `anchored`.
    """

    kind: str = "seam"
    chunks: int = 0
    budget: float = 1.0
    tokens: int = 0
    seam_tokens: int | None = None
    anchored: bool = False
    chained: bool = False

    def __post_init__(self) -> None:
        if self.kind not in POLICY_KINDS:
            raise RecomputePolicyError(f"unknown recompute policy {self.kind!r}; choose one of: {SPEC_HELP}")
        if self.seam_tokens is not None:
            _check_number(SEAM_TOKENS, self.seam_tokens, "a recompute policy's seam (@W)")
        _check_number(NumberRange(0, POLICY_CHUNKS.maximum), self.chunks, "a recompute policy's chunk count")
        _check_number(POLICY_BUDGET, self.budget, "a recompute policy's budget")
        _check_number(NumberRange(0, POLICY_TOKENS.maximum), self.tokens, "a recompute policy's token budget")
        if self.kind == "whole" and self.chunks < 1:
            raise RecomputePolicyError("policy whole needs a chunk count >= 1 (whole:N)")
        if self.kind == "tokens" and self.tokens < 1:
            raise RecomputePolicyError("policy tokens needs a token count >= 1 (tokens:N)")
        if self.kind != "tokens" and self.tokens:
            raise RecomputePolicyError(f"policy {self.kind} takes no token count")
        if self.kind != "whole" and self.chunks:
            raise RecomputePolicyError(f"policy {self.kind} takes no chunk count")
        if self.kind != "budget" and self.budget != 1:
            raise RecomputePolicyError(f"policy {self.kind} takes no budget")
        if not isinstance(self.anchored, bool):
            raise RecomputePolicyError(f"a recompute policy's anchored flag must be a bool, got {self.anchored!r}")
        if not isinstance(self.chained, bool):
            raise RecomputePolicyError(f"a recompute policy's chained flag must be a bool, got {self.chained!r}")
        if self.chained:
            object.__setattr__(self, "anchored", True)
        object.__setattr__(self, "budget", float(self.budget))

    # ------------------------------------------------------------------------------------------------ specs
    @classmethod
    def parse(cls, spec: str) -> RecomputePolicy:
        """The policy of a spec (`seam`, `seam@16`, `whole:1`, `whole:2@8`, `budget:2`, `budget:1.5@8`,
        `seam@0+anchored`); `RecomputePolicyError` naming the forms for anything else."""
        match = _SPEC.match(spec.strip()) if isinstance(spec, str) else None
        if match is None:
            raise RecomputePolicyError(f"not a recompute policy: {_shown_spec(spec)}; expected one of: {SPEC_HELP}")
        kind, amount, seam = match.group("kind"), match.group("amount"), match.group("seam")
        if kind not in POLICY_KINDS:
            raise RecomputePolicyError(f"unknown recompute policy {kind!r}; expected one of: {SPEC_HELP}")
        # every number of a spec is checked against its range here, before any is used (whatever the kind)
        seam_tokens = None if seam is None else _parse_number(SEAM_TOKENS, seam, "the seam (@W)", spec)
        anchored = match.group("anchored") is not None
        chained = match.group("anchored") == CHAINED_SUFFIX
        if kind == "seam":
            if amount is not None:
                raise RecomputePolicyError(f"policy seam takes no amount (seam or seam@W), got {spec!r}")
            return cls("seam", seam_tokens=seam_tokens, anchored=anchored, chained=chained)
        if amount is None:
            raise RecomputePolicyError(f"policy {kind} needs an amount ({kind}:N), got {spec!r}")
        if kind in ("whole", "tokens"):
            if "." in amount:
                raise RecomputePolicyError(f"policy {kind} takes a whole number, got {spec!r}")
            if kind == "tokens":
                return cls("tokens", tokens=_parse_number(POLICY_TOKENS, amount, "N of tokens:N", spec),
                           seam_tokens=seam_tokens, anchored=anchored, chained=chained)
            return cls("whole", chunks=_parse_number(POLICY_CHUNKS, amount, "N of whole:N", spec),
                       seam_tokens=seam_tokens, anchored=anchored, chained=chained)
        return cls("budget", budget=_parse_number(POLICY_BUDGET, amount, "X of budget:X", spec), seam_tokens=seam_tokens,
                   anchored=anchored, chained=chained)

    @property
    def spec(self) -> str:
        """The spec `parse` reads back into this policy."""
        seam = "" if self.seam_tokens is None else f"@{self.seam_tokens}"
        if self.anchored:
            seam += CHAINED_SUFFIX if self.chained else ANCHORED_SUFFIX
        if self.kind == "whole":
            return f"whole:{self.chunks}{seam}"
        if self.kind == "tokens":
            return f"tokens:{self.tokens}{seam}"
        if self.kind == "budget":
            return f"budget:{self.budget:g}{seam}"
        return f"seam{seam}"

    def __str__(self) -> str:
        return self.spec

    # ------------------------------------------------------------------------------------------------ plans
    def chunk_seam(self, default_seam: int) -> int:
        """The seam window of the chunks this policy does not recompute whole."""
        return check_seam_tokens(default_seam if self.seam_tokens is None else self.seam_tokens)

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
        if self.kind == "whole":
            for number in order[: self.chunks]:
                seams[number] = WHOLE
        elif self.kind in ("budget", "tokens"):
            spent = sum(min(seam, length) for length in chunk_lengths)
            allowed = self.budget * spent if self.kind == "budget" else float(self.tokens)
            for number in order:
                extra = chunk_lengths[number] - min(seam, chunk_lengths[number])
                if extra and spent + extra <= allowed + 1e-9:
                    seams[number] = WHOLE
                    spent += extra
        return RecomputePlan(tuple(seams))

    def resolved(self, default_seam: int) -> RecomputePolicy:
        """This policy with its seam made explicit (`default_seam` unless it names one)."""
        return RecomputePolicy(self.kind, chunks=self.chunks, budget=self.budget, tokens=self.tokens,
                               seam_tokens=self.chunk_seam(default_seam), anchored=self.anchored, chained=self.chained)

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


SEAM_POLICY = RecomputePolicy()
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
