"""The checks every hybrid family must pass (family_modes.py), one parametrized test each over the families' tiny
random fp32 models; what is particular to a family stays in its own test file.

- Deviation orderings: slow decays (A log-uniform in [0.005, 0.5]) on the Mamba families, peaked attention
  (initializer_range 0.2 in their tiny configs, 0.1 for the KDA / lightning families). OLMo keeps transformers' own
  init scale (0.02): at 0.1 its 8-layer stack is chaotic, every mode's mean KL is ~0.5 and hypic vs transition is
  within the requests' noise (docs/families_linear.md).
- Linear-only models: Nemotron-H and Zamba2 keep transformers' own decays (A = 1..H; dt in [0.001, 0.1]; Zamba2 with
  larger weights), so that `addition` (P = 1) visibly differs; Falcon-H1 has no layer without attention, so its
  attention branch is switched off (attention_out_multiplier 0); OLMo's config refuses a stack without attention, so
  its [linear, attention] stack loses the attention layer after it is built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from family_modes import (
    check_conv_tail_needs_the_seam,
    check_deviation_ordering,
    check_full_matches_transformers,
    check_linear_only_transition_is_exact,
    check_seams_and_prefix_are_exact,
    random_request,
    tiny_engine,
)

from hypic_rag.runtime.engine import Engine
from hypic_rag.runtime.families import family_for
from hypic_rag.runtime.families.bailing_hybrid import BailingHybrid
from hypic_rag.runtime.families.kimi_linear import KimiLinear
from hypic_rag.runtime.families.lfm2 import Lfm2
from hypic_rag.runtime.families.minimax import MiniMax
from hypic_rag.runtime.families.olmo_hybrid import OlmoHybrid
from hypic_rag.runtime.model import wrap_model
from hypic_rag.testing import build_tiny_model
from kits.mixer_checks import check_recurrent_mixer


@dataclass(frozen=True)
class TinyModel:
    """`tiny_engine(model_type, **options)`, and where its recurrent mixer is and how the mixer contract feeds it
    (`tokens` random inputs from seed `seed`, split after `split`)."""

    model_type: str
    options: dict[str, object] = field(default_factory=dict)
    tokens: int = 37
    split: int = 13
    seed: int = 2
    moves_keys: bool | None = None  # whether re-positioning moves its cached keys (RoPE); None: not checked here
    mixer_of: Callable[[Engine], torch.nn.Module] = lambda engine: engine.model.blocks[0].mixer


MAMBA_CONTRACT = {"tokens": 41, "split": 17, "seed": 5}  # the Mamba families' mixer contract inputs
TINY = {
    "bamba": TinyModel("bamba", **MAMBA_CONTRACT, moves_keys=True),
    "falcon_h1": TinyModel("falcon_h1", **MAMBA_CONTRACT, moves_keys=True,
                           mixer_of=lambda engine: engine.model.blocks[0].branches[0].mixer),
    "jamba": TinyModel("jamba", **MAMBA_CONTRACT, moves_keys=False),
    "nemotron_h": TinyModel("nemotron_h", **MAMBA_CONTRACT, moves_keys=False),
    "zamba2-nope": TinyModel("zamba2", {"use_mem_rope": False}, **MAMBA_CONTRACT, moves_keys=False),
    "zamba2-rope": TinyModel("zamba2", {"use_mem_rope": True}, **MAMBA_CONTRACT, moves_keys=True),
    "granitemoehybrid-nope": TinyModel("granitemoehybrid", {"position_embedding_type": "nope"}, **MAMBA_CONTRACT,
                                       moves_keys=False),
    "granitemoehybrid-rope": TinyModel("granitemoehybrid", {"position_embedding_type": "rope"}, **MAMBA_CONTRACT,
                                       moves_keys=True),
    "bailing_hybrid": TinyModel("bailing_hybrid"),
    "kimi_linear": TinyModel("kimi_linear"),
    "minimax": TinyModel("minimax"),
    "olmo_hybrid": TinyModel("olmo_hybrid"),
    "lfm2": TinyModel("lfm2", tokens=19, split=7, mixer_of=lambda engine: engine.model.blocks[
        engine.model.hf_model.config.layer_types.index("conv")].mixer),
}


@pytest.mark.parametrize(("model_type", "adapter"), [
    ("bailing_hybrid", BailingHybrid), ("kimi_linear", KimiLinear), ("minimax", MiniMax), ("olmo_hybrid", OlmoHybrid),
    ("lfm2", Lfm2),
])
def test_family_for_finds_the_adapter(model_type: str, adapter: type) -> None:
    assert isinstance(family_for(model_type), adapter)


@pytest.fixture(scope="module", params=tuple(TINY))
def tiny(request: pytest.FixtureRequest):
    """(the case, the transformers model, an engine over it with a seam of 4)."""
    case = TINY[request.param]
    return (case, *tiny_engine(case.model_type, **case.options))


def test_full_matches_transformers_logits_and_greedy_tokens(tiny) -> None:
    _, hf_model, engine = tiny
    check_full_matches_transformers(hf_model, engine)


def test_hypic_with_seam_covering_every_chunk_and_prefix_equal_full(tiny) -> None:
    check_seams_and_prefix_are_exact(tiny[2])


def test_the_recurrent_mixer_meets_the_contract(tiny) -> None:
    case, hf_model, engine = tiny
    x = torch.randn(case.tokens, hf_model.config.hidden_size, generator=torch.Generator().manual_seed(case.seed))
    check_recurrent_mixer(case.mixer_of(engine), x, split=case.split)


WITH_KNOWN_POSITIONS = tuple(name for name, case in TINY.items() if case.moves_keys is not None)


@pytest.mark.parametrize("tiny", WITH_KNOWN_POSITIONS, indirect=True)
def test_repositioning_moves_the_cached_keys_only_with_rope(tiny) -> None:
    case, _, engine = tiny
    request = random_request(torch.Generator().manual_seed(2), [14, 21, 9])
    transition = engine.prefill(request, "transition").logits
    transition_rope = engine.prefill(request, "transition_rope").logits
    if case.moves_keys:
        assert (transition_rope - transition).abs().max() > 1e-4
    else:
        torch.testing.assert_close(transition_rope, transition, atol=1e-6, rtol=1e-6)


@dataclass(frozen=True)
class LinearOnlyModel:
    """A one-layer model (seed 9) whose layer is the family's recurrent mixer, its conv kernel set through
    `conv_option` (None: the mixer has no conv), wrapped with a seam of 3."""

    model_type: str
    conv_option: str | None
    options: dict[str, object] = field(default_factory=dict)
    layer_types: tuple[str, ...] = ("linear_attention",)
    drop_attention_layer: bool = False

    def engine(self, conv_kernel: int) -> Engine:
        conv = {} if self.conv_option is None else {self.conv_option: conv_kernel}
        if self.drop_attention_layer:
            hf_model = build_tiny_model(self.model_type, seed=9, num_hidden_layers=2,
                                        layer_types=["linear_attention", "full_attention"], **conv, **self.options)
            del hf_model.model.layers[1]
        else:
            hf_model = build_tiny_model(self.model_type, seed=9, num_hidden_layers=1, **conv, **self.options)
        engine = Engine(wrap_model(hf_model), seam_tokens=3)
        assert engine.model.layer_types == self.layer_types
        return engine


LINEAR_ONLY = {
    "bamba": LinearOnlyModel("bamba", "mamba_d_conv"),
    "falcon_h1": LinearOnlyModel("falcon_h1", "mamba_d_conv", {"attention_out_multiplier": 0.0},
                                 layer_types=("linear_attention+full_attention",)),
    "jamba": LinearOnlyModel("jamba", "mamba_d_conv"),
    "nemotron_h": LinearOnlyModel("nemotron_h", "conv_kernel", {"slow_decay": False}),
    "zamba2": LinearOnlyModel("zamba2", "mamba_d_conv", {"slow_decay": False, "initializer_range": 0.3}),
    "granitemoehybrid": LinearOnlyModel("granitemoehybrid", "mamba_d_conv", {"layer_types": ["linear_attention"]}),
    "bailing_hybrid": LinearOnlyModel("bailing_hybrid", "short_conv_kernel_size",
                                      {"layer_types": ["linear_attention"]}),
    "kimi_linear": LinearOnlyModel("kimi_linear", "linear_conv_kernel_dim", {"layer_types": ["linear_attention"]}),
    "minimax": LinearOnlyModel("minimax", None, {"layer_types": ["linear_attention"]}),  # lightning has no conv
    "olmo_hybrid": LinearOnlyModel("olmo_hybrid", "linear_conv_kernel_dim", drop_attention_layer=True),
    "qwen3_5": LinearOnlyModel("qwen3_5", "linear_conv_kernel_dim", {"layer_types": ["linear_attention"]}),
}
WITH_A_CONV_TAIL = ("bamba", "falcon_h1", "jamba", "nemotron_h", "zamba2", "granitemoehybrid", "qwen3_5")


@pytest.mark.parametrize("family", tuple(LINEAR_ONLY))
@pytest.mark.parametrize("chunks", [2, 4, 6])
def test_linear_only_transition_is_exact_with_conv_kernel_one(family: str, chunks: int) -> None:
    check_linear_only_transition_is_exact(LINEAR_ONLY[family].engine(conv_kernel=1), chunks)


@pytest.mark.parametrize("family", WITH_A_CONV_TAIL)
def test_linear_only_conv_kernel_four_needs_the_seam(family: str) -> None:
    check_conv_tail_needs_the_seam(LINEAR_ONLY[family].engine(conv_kernel=4), seam=3)


DEVIATION = {  # name: (model_type, layers, options, whether re-positioning moves keys)
    "bamba": ("bamba", 8, {}, True),
    "falcon_h1": ("falcon_h1", 6, {}, True),
    "jamba": ("jamba", 8, {}, False),
    "nemotron_h": ("nemotron_h", 8, {}, False),
    "zamba2-nope": ("zamba2", 6, {"use_mem_rope": False}, False),
    "zamba2-rope": ("zamba2", 6, {"use_mem_rope": True}, True),
    "bailing_hybrid": ("bailing_hybrid", 8, {"initializer_range": 0.1}, True),
    "kimi_linear": ("kimi_linear", 8, {"initializer_range": 0.1}, False),
    "minimax": ("minimax", 8, {"initializer_range": 0.1}, True),
    "olmo_hybrid": ("olmo_hybrid", 8, {"initializer_range": 0.02}, False),
}


@pytest.mark.parametrize("name", tuple(DEVIATION))
def test_deviation_from_full_is_ordered_over_random_requests(name: str) -> None:
    """Mean KL over 20 requests (seam 8): hypic < transition_rope < addition with RoPE, hypic < transition <
    addition without."""
    model_type, layers, options, moves_keys = DEVIATION[name]
    hf_model = build_tiny_model(model_type, seed=0, num_hidden_layers=layers, **options)
    check_deviation_ordering(Engine(wrap_model(hf_model), seam_tokens=8), moves_keys=moves_keys)
