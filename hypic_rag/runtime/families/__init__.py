"""Family adapters by `config.model_type` (`base.register_family`, `base.family_for`). Importing this package
registers every family the runtime ships; a new family adds its module here."""

from hypic_rag.runtime.families import qwen  # noqa: F401, I001  (importing registers them, in this order)
from hypic_rag.runtime.families import granite, lfm2  # noqa: F401
from hypic_rag.runtime.families import kimi_linear, bailing_hybrid, olmo_hybrid, minimax  # noqa: F401
from hypic_rag.runtime.families import bamba, falcon_h1, jamba, nemotron_h, zamba2  # noqa: F401  (Mamba-family hybrids)
from hypic_rag.runtime.families.base import Family, family_for, register_family, supported_model_types, text_backbone

__all__ = ["Family", "family_for", "register_family", "supported_model_types", "text_backbone"]
