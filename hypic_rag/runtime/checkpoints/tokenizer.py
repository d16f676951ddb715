"""A checkpoint's tokenizer without transformers: `tokenizers` reads `tokenizer.json`, this module does the rest.

Importing transformers costs seconds, a one-shot `hypic-rag ask` cannot pay for it. `load_tokenizer(path)` builds
a `CheckpointTokenizer` that behaves exactly like what `transformers.AutoTokenizer.from_pretrained(path,
local_files_only=True)` returns (transformers 5's `TokenizersBackend`) for every use the project makes of a
tokenizer: `tokenizer(text or texts, add_special_tokens=..., return_offsets_mapping=..., verbose=...)`, `decode`,
the special tokens and their ids, `get_vocab`, `len`, `chat_template` / `apply_chat_template`, `copy.deepcopy`,
pickling, and the `backend_tokenizer.to_str()` + `all_special_tokens` pair `runtime.model.tokenizer_digest` hashes
(equal for both loaders of one directory, so cache keys do not depend on which one ran).

For Qwen3.5 checkpoints (model types `qwen3_5`, `qwen3_5_moe`, `qwen3_5_moe_text`) AutoTokenizer does not use
`tokenizer.json` as it is: it builds transformers' `Qwen3_5Tokenizer`, which keeps only the file's vocabulary,
merges, post-processor and added tokens and rebuilds the rest (NFC, Qwen3.5's split regex, byte-level pre-tokenizer
and decoder, its own BPE options, `<|endoftext|>` as default unk / eos / pad). `_qwen3_5_backend` builds the same.

It reproduces only what it was checked against (tests/runtime/test_tokenizer.py); for anything else it returns
None and the caller uses transformers: no `tokenizer.json`, a `tokenizer_class` other than the generic fast
classes (for Qwen3.5: other than `QWEN3_5_DECLARED_CLASSES`), a model type whose tokenizer class it does not
rebuild, remote code, legacy `special_tokens_map.json` / `added_tokens.json` files, truncation or padding baked into
`tokenizer.json`, named chat templates, model-specific named tokens (`image_token`, ...), a tokenizer_config key it
does not know.

What transformers does to the backend at load time, done here too: a `tokenizer.json` without a post-processor
gets an empty `TemplateProcessing` (`$A:0` / `$A:0 $B:1`); the named special tokens (`eos_token`, `pad_token`, ...)
and `extra_special_tokens` missing from the added vocabulary are added as special added tokens; the backend's
`encode_special_tokens` follows `split_special_tokens`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, processors

from hypic_rag.runtime.checkpoints.files import read_json

logger = logging.getLogger(__name__)

NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The named special tokens, in the order `all_special_tokens` lists them (transformers' order)."""

GENERIC_TOKENIZER_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
"""`tokenizer_class` values this module reproduces: the generic `tokenizer.json` wrapper (and its v4 name)."""

GENERIC_MODEL_TYPES = frozenset({
    "qwen3_5_text", "qwen3_next", "granitemoehybrid", "lfm2", "kimi_linear", "olmo_hybrid", "minimax", "bamba",
    "falcon_h1", "jamba", "nemotron_h", "zamba2",
})
"""`config.model_type` values for which AutoTokenizer loads a generic `tokenizer_class` as plain
`TokenizersBackend` (checked against the installed transformers by the tests). Not `QWEN3_5_MODEL_TYPES`:
transformers replaces their declared class with `Qwen3_5Tokenizer`, which rebuilds the backend with its own
pre-tokenizer (reproduced separately)."""

QWEN3_5_MODEL_TYPES = frozenset({"qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text"})
"""`config.model_type` values for which AutoTokenizer builds transformers' `Qwen3_5Tokenizer` whatever
`tokenizer_class` the checkpoint declares; `load_tokenizer` rebuilds the same backend (`_qwen3_5_backend`)."""

QWEN3_5_DECLARED_CLASSES = frozenset({
    "Qwen3_5Tokenizer", "Qwen2Tokenizer", "Qwen2TokenizerFast", "TokenizersBackend", "PreTrainedTokenizerFast",
})
"""`tokenizer_class` values of a Qwen3.5 checkpoint this module accepts (each checked against AutoTokenizer by the
tests)."""

QWEN3_5_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
"""The pre-tokenizer split of Qwen3.5's tokenizer (letters with their combining marks, digits one by one, ...),
as transformers 5.24 writes it: the tests compare the whole serialised backend, so a change there is caught."""

QWEN3_5_DEFAULT_SPECIAL_TOKENS = {"unk_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
"""The named special tokens `Qwen3_5Tokenizer` sets when tokenizer_config.json does not name them (an explicit
null unsets them)."""

_ADDED_TOKEN_FIELDS = frozenset({"content", "single_word", "lstrip", "rstrip", "normalized", "special"})

_IGNORED_CONFIG_KEYS = frozenset({
    "tokenizer_class", "backend", "is_local", "local_files_only", "name_or_path", "errors", "add_prefix_space",
    "add_bos_token", "add_eos_token", "padding_side", "truncation_side", "processor_class", "files_loaded",
})
"""tokenizer_config.json keys with no effect on what the project uses (`add_bos_token` / `add_eos_token` are
dropped by transformers when a `tokenizer.json` is present)."""

_READ_CONFIG_KEYS = frozenset({
    *NAMED_SPECIAL_TOKENS, "extra_special_tokens", "additional_special_tokens", "added_tokens_decoder",
    "chat_template", "model_max_length", "model_input_names", "clean_up_tokenization_spaces", "split_special_tokens",
})
"""tokenizer_config.json keys this module reads."""

DEFAULT_MODEL_INPUT_NAMES = ("input_ids", "attention_mask")
VERY_LARGE_INTEGER = int(1e30)
"""transformers' `model_max_length` when the config gives none."""


class CheckpointTokenizer:
    """A `tokenizers.Tokenizer` with the special tokens, chat template and call conventions of transformers' fast
    tokenizer of the same checkpoint directory. Build it with `load_tokenizer`."""

    is_fast = True

    def __init__(
        self, backend: Tokenizer, *, name_or_path: str, special_tokens: Mapping[str, str],
        extra_special_tokens: Sequence[str], chat_template: str | None, model_max_length: int,
        model_input_names: Sequence[str], split_special_tokens: bool,
        model_specific_tokens: Mapping[str, str] | None = None,
    ) -> None:
        """special_tokens: the standard named tokens (`NAMED_SPECIAL_TOKENS`) that are set; model_specific_tokens:
        further named ones (`image_token`, ...), listed after them, in order."""
        unknown = set(special_tokens) - set(NAMED_SPECIAL_TOKENS)
        if unknown:
            raise ValueError(f"unknown special token names {sorted(unknown)}; known: {NAMED_SPECIAL_TOKENS}")
        clashing = set(model_specific_tokens or {}) & set(NAMED_SPECIAL_TOKENS)
        if clashing:
            raise ValueError(f"model-specific special token names {sorted(clashing)} are standard names")
        self._backend = backend
        self.name_or_path = name_or_path
        self._special_tokens = {name: special_tokens[name] for name in NAMED_SPECIAL_TOKENS if name in special_tokens}
        self._special_tokens.update(model_specific_tokens or {})
        self._extra_special_tokens = list(extra_special_tokens)
        self.chat_template = chat_template
        self.model_max_length = model_max_length
        self.model_input_names = list(model_input_names)
        self.split_special_tokens = split_special_tokens
        self._warned_too_long = False

    # -- vocabulary and special tokens -------------------------------------------------------------------------

    @property
    def backend_tokenizer(self) -> Tokenizer:
        """The `tokenizers.Tokenizer` doing the work (its `to_str()` is what `tokenizer_digest` hashes)."""
        return self._backend

    def __len__(self) -> int:
        """Vocabulary size with the added tokens."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def __bool__(self) -> bool:
        return True

    @property
    def vocab_size(self) -> int:
        """Vocabulary size without the added tokens."""
        return self._backend.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> dict[str, int]:
        """Token -> id, added tokens included."""
        return self._backend.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        """The id of a token (the unknown token's id, or None, when it is not in the vocabulary); a list for a list."""
        if isinstance(tokens, str):
            return self._token_id(tokens)
        return [self._token_id(token) for token in tokens]

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self._backend.id_to_token(ids)
        return [self._backend.id_to_token(int(index)) for index in ids]

    def _token_id(self, token: str) -> int | None:
        index = self._backend.token_to_id(token)
        if index is None:
            unknown = self._special_tokens.get("unk_token")
            return None if unknown is None else self._backend.token_to_id(unknown)
        return index

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """Named special token -> its text (only the ones set; model-specific ones last); these are also the chat
        template's variables."""
        return dict(self._special_tokens)

    @property
    def extra_special_tokens(self) -> list[str]:
        return list(self._extra_special_tokens)

    @property
    def all_special_tokens(self) -> list[str]:
        """The named special tokens then the extra ones, each once, in transformers' order."""
        return list(dict.fromkeys([*self._special_tokens.values(), *self._extra_special_tokens]))

    @property
    def all_special_ids(self) -> list[int | None]:
        return [self._token_id(token) for token in self.all_special_tokens]

    def _named(self, name: str) -> str | None:
        return self._special_tokens.get(name)

    def _named_id(self, name: str) -> int | None:
        token = self._special_tokens.get(name)
        return None if token is None else self._token_id(token)

    bos_token = property(lambda self: self._named("bos_token"))
    eos_token = property(lambda self: self._named("eos_token"))
    unk_token = property(lambda self: self._named("unk_token"))
    sep_token = property(lambda self: self._named("sep_token"))
    pad_token = property(lambda self: self._named("pad_token"))
    cls_token = property(lambda self: self._named("cls_token"))
    mask_token = property(lambda self: self._named("mask_token"))
    bos_token_id = property(lambda self: self._named_id("bos_token"))
    eos_token_id = property(lambda self: self._named_id("eos_token"))
    unk_token_id = property(lambda self: self._named_id("unk_token"))
    sep_token_id = property(lambda self: self._named_id("sep_token"))
    pad_token_id = property(lambda self: self._named_id("pad_token"))
    cls_token_id = property(lambda self: self._named_id("cls_token"))
    mask_token_id = property(lambda self: self._named_id("mask_token"))

    # -- encoding and decoding ---------------------------------------------------------------------------------

    def __call__(
        self, text: str | Sequence[str], *, add_special_tokens: bool = True, return_offsets_mapping: bool = False,
        return_attention_mask: bool | None = None, return_token_type_ids: bool | None = None, verbose: bool = True,
    ) -> dict[str, list[Any]]:
        """Encode one text (values are flat lists) or a list of texts (values are lists of lists).

        Keys: `input_ids`; `token_type_ids` and `attention_mask` when `model_input_names` names them (or when asked);
        `offset_mapping` ((start, end) character spans) with `return_offsets_mapping`. ValueError for input that is
        neither a str nor a list/tuple of str."""
        batched = isinstance(text, (list, tuple))
        if batched:
            if text and not isinstance(text[0], str):
                raise ValueError("text input must be a str or a list of str (pre-tokenized input is not supported)")
            texts = list(text)
        elif isinstance(text, str):
            texts = [text]
        else:
            raise ValueError(f"text input must be a str or a list of str, got {type(text).__name__}")
        if self._backend.encode_special_tokens != self.split_special_tokens:
            self._backend.encode_special_tokens = self.split_special_tokens
        encodings = self._backend.encode_batch(texts, add_special_tokens=add_special_tokens) if texts else []
        with_type_ids = "token_type_ids" in self.model_input_names if return_token_type_ids is None else return_token_type_ids
        with_mask = "attention_mask" in self.model_input_names if return_attention_mask is None else return_attention_mask
        result: dict[str, list[Any]] = {"input_ids": [encoding.ids for encoding in encodings]}
        if with_type_ids:
            result["token_type_ids"] = [encoding.type_ids for encoding in encodings]
        if with_mask:
            result["attention_mask"] = [encoding.attention_mask for encoding in encodings]
        if return_offsets_mapping:
            result["offset_mapping"] = [encoding.offsets for encoding in encodings]
        for ids in result["input_ids"]:
            self._warn_if_too_long(len(ids), verbose)
        if not batched:
            return {key: value[0] for key, value in result.items()}
        return result

    def encode(self, text: str, *, add_special_tokens: bool = True, verbose: bool = True) -> list[int]:
        """The token ids of one text (transformers' `encode` without its padding / truncation options)."""
        if not isinstance(text, str):
            raise ValueError(f"text input must be a str, got {type(text).__name__}")
        return list(self(text, add_special_tokens=add_special_tokens, verbose=verbose)["input_ids"])

    def _warn_if_too_long(self, length: int, verbose: bool) -> None:
        if verbose and self.model_max_length and length > self.model_max_length and not self._warned_too_long:
            logger.warning(
                "Token indices sequence length is longer than the specified maximum sequence length for this model "
                "(%d > %d). Running this sequence through the model will result in indexing errors",
                length, self.model_max_length,
            )
            self._warned_too_long = True

    def decode(self, token_ids: Any, skip_special_tokens: bool = False) -> str | list[str]:
        """The text of `token_ids` (an int, a sequence of ints, a tensor / array; a list of sequences gives a list of
        texts). skip_special_tokens: drop the added tokens marked special."""
        if hasattr(token_ids, "tolist"):
            token_ids = token_ids.tolist()
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        if isinstance(token_ids, (list, tuple)) and token_ids and isinstance(token_ids[0], (list, tuple)):
            return [self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens) for ids in token_ids]
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(list(ids), skip_special_tokens=skip_special_tokens) for ids in sequences]

    # -- chat template -----------------------------------------------------------------------------------------

    def apply_chat_template(
        self, conversation: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False, tokenize: bool = True,
        chat_template: str | None = None, **template_variables: Any,
    ) -> str | dict[str, list[Any]]:
        """Render one conversation (a list of message dicts) with the chat template, as transformers does:
        a sandboxed jinja2 environment with `trim_blocks` / `lstrip_blocks`, `messages` (keys whose value is None
        dropped), `tools=None`, `documents=None`, `add_generation_prompt`, the named special tokens and
        `template_variables`. tokenize: return `self(rendered, add_special_tokens=False)` instead of the text.
        ValueError when there is no template or the conversation is empty."""
        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            raise ValueError(
                "Cannot use chat template functions because tokenizer.chat_template is not set and no template "
                "argument was passed!"
            )
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        messages = []
        for message in conversation:
            if not isinstance(message, Mapping):
                raise TypeError(f"Chat messages should be dicts, but got {message!r}.")
            messages.append(_with_reasoning_aliases({key: value for key, value in message.items() if value is not None}))
        variables = {**self.special_tokens_map, **template_variables}
        rendered = _compiled_template(template).render(
            messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt, **variables
        )
        if tokenize:
            return self(rendered, add_special_tokens=False)
        return rendered

    def __repr__(self) -> str:
        return (f"CheckpointTokenizer(name_or_path={self.name_or_path!r}, vocab_size={len(self)}, "
                f"special_tokens={self.all_special_tokens})")


_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _with_reasoning_aliases(message: dict[str, Any]) -> dict[str, Any]:
    """A message's reasoning under both names templates read (`reasoning_content`, `thinking`), as transformers
    passes it."""
    reasoning = next((message[key] for key in _REASONING_KEYS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


@lru_cache(maxsize=16)
def _compiled_template(template: str) -> Any:
    """`template` compiled in a sandbox with the helpers Hub chat templates call (`raise_exception`, `tojson`
    without HTML escaping, `strftime_now`, `namespace`, `dict`, loop controls, a no-op `{% generation %}` block)."""
    from datetime import datetime

    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):
        """`{% generation %}...{% endgeneration %}` renders its body (transformers tracks assistant spans with it)."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller: Any) -> str:
            return caller()

    class SafeNamespace(jinja2.utils.Namespace):
        """A jinja `namespace` that refuses underscore-prefixed attribute names."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attributes = dict(*rest, **kwargs)
            for name in attributes:
                SafeNamespace.check(name)
            jinja2.utils.Namespace.__init__(self, attributes)

        def __setitem__(self, name: str, value: Any) -> None:
            SafeNamespace.check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore-prefixed attribute {name!r}")

    class DictBuilder:
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def to_json(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
                sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = to_json
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    environment.globals["dict"] = DictBuilder()
    environment.globals["namespace"] = SafeNamespace
    return environment.from_string(template)


# -- loading ---------------------------------------------------------------------------------------------------


def special_token_text(value: Any) -> str | None:
    """The text of a special token as tokenizer_config.json gives it (a str or a serialised AddedToken); None for
    anything else."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _added_token(entry: Mapping[str, Any]) -> AddedToken:
    fields = {key: value for key, value in entry.items() if key != "__type"}
    return AddedToken(**fields)


def load_tokenizer(path: str | Path) -> CheckpointTokenizer | None:
    """The tokenizer of the checkpoint directory `path`, identical in behaviour to transformers'
    `AutoTokenizer.from_pretrained(path, local_files_only=True)`; None when the directory is not one this module
    reproduces exactly (see the module docstring) — the caller then uses transformers. Unreadable or malformed JSON
    also gives None (transformers reports those itself)."""
    directory = Path(path)
    try:
        return _load(directory)
    except Exception as error:  # noqa: BLE001 - unreadable files, malformed JSON (tokenizers raises Exception)
        logger.debug("no transformers-free tokenizer for %s: %s", directory, error)
        return None


def _load(directory: Path) -> CheckpointTokenizer | None:
    tokenizer_file = directory / "tokenizer.json"
    config_file = directory / "tokenizer_config.json"
    model_config_file = directory / "config.json"
    if not (tokenizer_file.is_file() and config_file.is_file() and model_config_file.is_file()):
        return None
    config = read_json(config_file)
    model_config = read_json(model_config_file)
    if not isinstance(config, dict) or not isinstance(model_config, dict):
        return None
    model_type = model_config.get("model_type")
    rebuilt = model_type in QWEN3_5_MODEL_TYPES
    unknown_keys = set(config) - _IGNORED_CONFIG_KEYS - _READ_CONFIG_KEYS
    if rebuilt:  # model-specific named tokens (`image_token`, ...) are read for Qwen3.5
        unknown_keys = {key for key in unknown_keys if not key.endswith("_token")}
    if unknown_keys:
        return None  # auto_map, fast_tokenizer_files, model-specific tokens, ...: not reproduced
    if rebuilt:
        if config.get("tokenizer_class") not in QWEN3_5_DECLARED_CLASSES:
            return None
    elif config.get("tokenizer_class") not in GENERIC_TOKENIZER_CLASSES or model_type not in GENERIC_MODEL_TYPES:
        return None
    if "auto_map" in model_config:
        return None
    if "added_tokens_decoder" not in config and any(
        (directory / name).exists() for name in ("special_tokens_map.json", "added_tokens.json")
    ):
        return None  # the legacy files would add or rename special tokens
    template_directory = directory / "additional_chat_templates"
    if template_directory.is_dir() and any(template_directory.glob("*.jinja")):
        return None  # named templates: transformers holds a dict of them
    if config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"):
        return None

    chat_template = config.get("chat_template")
    template_file = directory / "chat_template.jinja"
    if template_file.is_file():
        chat_template = template_file.read_text(encoding="utf-8")
    if chat_template is not None and not isinstance(chat_template, str):
        return None  # named templates
    split_special_tokens = bool(config.get("split_special_tokens", False))
    model_max_length = config.get("model_max_length")
    model_input_names = config.get("model_input_names", DEFAULT_MODEL_INPUT_NAMES)

    if rebuilt:
        built = _qwen3_5_backend(tokenizer_file, config, split_special_tokens)
    else:
        built = _generic_backend(tokenizer_file, config, split_special_tokens)
    if built is None:
        return None
    backend, special_tokens, extra_special_tokens = built
    model_specific_tokens = {name: text for name, text in special_tokens.items() if name not in NAMED_SPECIAL_TOKENS}
    special_tokens = {name: text for name, text in special_tokens.items() if name in NAMED_SPECIAL_TOKENS}
    return CheckpointTokenizer(
        backend,
        name_or_path=str(directory),
        special_tokens=special_tokens,
        extra_special_tokens=extra_special_tokens,
        chat_template=chat_template,
        model_max_length=int(model_max_length) if model_max_length is not None else VERY_LARGE_INTEGER,
        model_input_names=model_input_names,
        split_special_tokens=split_special_tokens,
        model_specific_tokens=model_specific_tokens,
    )


_Built = tuple[Tokenizer, dict[str, str], list[str]]
"""A loader's backend, named special tokens (name -> text; standard names, then model-specific ones) and extra
special tokens."""


def _extra_special_values(config: Mapping[str, Any]) -> list[Any] | None:
    """The configured extra special tokens as given (`extra_special_tokens`, else the legacy
    `additional_special_tokens`); None for a dict of named model-specific tokens (not reproduced)."""
    values = config.get("extra_special_tokens")
    if not values:
        values = config.get("additional_special_tokens")
    if values is None:
        return []
    if not isinstance(values, (list, tuple)):
        return None
    return list(values)


def _generic_backend(tokenizer_file: Path, config: Mapping[str, Any], split_special_tokens: bool) -> _Built | None:
    """`tokenizer.json` as it is, with what transformers' `TokenizersBackend` adds at load time."""
    backend = Tokenizer.from_file(str(tokenizer_file))
    if backend.truncation is not None or backend.padding is not None:
        return None  # transformers resets them on the first call: its digest would change after loading
    if config.get("clean_up_tokenization_spaces") and type(backend.model).__name__ != "BPE":
        return None  # transformers' space clean-up on decode (it skips it for BPE)

    added = backend.get_added_tokens_decoder()
    for index, entry in (config.get("added_tokens_decoder") or {}).items():
        if not isinstance(entry, Mapping):
            return None
        present = added.get(int(index))
        if present is None or repr(present) != repr(_added_token(entry)):
            return None  # transformers would add or re-flag it

    special_tokens: dict[str, str] = {}
    for name in NAMED_SPECIAL_TOKENS:
        value = config.get(name)
        if value is None:
            continue
        text = special_token_text(value)
        if text is None or (not isinstance(value, str) and backend.token_to_id(text) is None):
            return None
        special_tokens[name] = text
    extras_value = _extra_special_values(config)
    if extras_value is None:
        return None
    extra_special_tokens: list[str] = []
    for value in extras_value:
        text = special_token_text(value)
        if text is None or (not isinstance(value, str) and backend.token_to_id(text) is None):
            return None
        extra_special_tokens.append(text)

    if backend.post_processor is None:
        backend.post_processor = _plain_post_processor()
    backend.encode_special_tokens = split_special_tokens
    known = {token.content for token in backend.get_added_tokens_decoder().values()}
    missing = [text for text in dict.fromkeys([*special_tokens.values(), *extra_special_tokens]) if text not in known]
    if missing:
        backend.add_tokens([AddedToken(text, special=True) for text in missing])
    return backend, special_tokens, extra_special_tokens


def _plain_post_processor() -> Any:
    """The post-processor transformers gives a backend without one (no bos / eos added): `$A:0`, `$A:0 $B:1`."""
    return processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])


# -- Qwen3.5: the backend rebuilt from the vocabulary and merges ----------------------------------------------


def _special_value(value: Any) -> str | AddedToken | None:
    """A special token as transformers holds it after reading tokenizer_config.json: a str, or an AddedToken for a
    serialised one (`"__type": "AddedToken"`); None for anything else (transformers rejects or mangles those)."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and value.get("__type") == "AddedToken" and isinstance(value.get("content"), str):
        fields = {key: field for key, field in value.items() if key != "__type"}
        if set(fields) - _ADDED_TOKEN_FIELDS:
            return None
        return AddedToken(**fields)
    return None


def _model_specific_tokens(config: Mapping[str, Any]) -> dict[str, str] | None:
    """Model-specific named special tokens as transformers collects them: tokenizer_config.json's `*_token` keys
    outside `NAMED_SPECIAL_TOKENS` (and `add_bos_token`, ...) with a string value, in file order, then a dict
    `extra_special_tokens`'s entries.
    None for what it does not reproduce (a non-string value, a standard name in the dict)."""
    tokens: dict[str, str] = {}
    for key, value in config.items():
        if key.endswith("_token") and key not in NAMED_SPECIAL_TOKENS and key not in _IGNORED_CONFIG_KEYS:
            if not isinstance(value, str):
                return None
            tokens[key] = value
    extras = config.get("extra_special_tokens")
    if isinstance(extras, dict):
        for key, value in extras.items():
            if not isinstance(key, str) or key in NAMED_SPECIAL_TOKENS or not isinstance(value, str):
                return None
            tokens[key] = value
    return tokens


def _qwen3_5_added_tokens(tokenizer_json: Mapping[str, Any], config: Mapping[str, Any]) -> dict[int, AddedToken] | None:
    """id -> AddedToken as transformers collects them before building the backend: tokenizer_config.json's
    `added_tokens_decoder` when it has one, else `tokenizer.json`'s `added_tokens`."""
    if "added_tokens_decoder" in config:
        entries = config["added_tokens_decoder"] or {}
        if not isinstance(entries, Mapping):
            return None
        result: dict[int, AddedToken] = {}
        for index, entry in entries.items():
            if not isinstance(entry, Mapping) or set(entry) - _ADDED_TOKEN_FIELDS:
                return None
            result[int(index)] = AddedToken(**entry)
        return result
    result = {}
    for entry in tokenizer_json.get("added_tokens") or []:
        fields = {key: value for key, value in entry.items() if key != "id"}
        if set(fields) - _ADDED_TOKEN_FIELDS:
            return None
        result[int(entry["id"])] = AddedToken(**fields)
    return result


def _qwen3_5_model(tokenizer_json: Mapping[str, Any]) -> Any | None:
    """The BPE model transformers' `Qwen3_5Tokenizer` builds from `tokenizer.json`'s vocabulary and merges: its own
    options (no unknown token, empty prefix / suffix, no byte fallback), not the file's."""
    from tokenizers.models import BPE

    model = tokenizer_json.get("model")
    if not isinstance(model, Mapping) or model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        return None
    merges: list[tuple[str, ...]] = []
    for merge in model.get("merges") or []:
        pair = tuple(merge.split(" ")) if isinstance(merge, str) else tuple(merge)
        if len(pair) != 2:
            return None
        merges.append(pair)
    return BPE(
        vocab=model["vocab"], merges=merges, dropout=None, unk_token=None, continuing_subword_prefix="",
        end_of_word_suffix="", fuse_unk=False, byte_fallback=False,
    )


def _without_vocabulary(tokenizer_json: Mapping[str, Any]) -> Tokenizer:
    """`tokenizer.json` parsed without its vocabulary, merges and added tokens (cheap): for its post-processor,
    truncation and padding."""
    light = dict(tokenizer_json)
    light["model"] = {**tokenizer_json["model"], "vocab": {}, "merges": []}
    light["added_tokens"] = []
    return Tokenizer.from_str(json.dumps(light))


def _qwen3_5_backend(tokenizer_file: Path, config: Mapping[str, Any], split_special_tokens: bool) -> _Built | None:
    """The backend transformers' `Qwen3_5Tokenizer` builds (for model types `qwen3_5`, `qwen3_5_moe`,
    `qwen3_5_moe_text`, whatever `tokenizer_class` the checkpoint declares): the file's vocabulary and merges in a
    fresh BPE; NFC; Qwen3.5's split regex then byte-level without its own regex; byte-level decoding; the file's
    post-processor (else the plain one); then the added tokens in id order, and the special tokens missing from
    them, added as transformers adds them (unk, eos, pad default to `<|endoftext|>`)."""
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers

    tokenizer_json = read_json(tokenizer_file)
    if not isinstance(tokenizer_json, dict):
        return None
    add_prefix_space = config.get("add_prefix_space")
    if add_prefix_space is not None and not isinstance(add_prefix_space, bool):
        return None
    model = _qwen3_5_model(tokenizer_json)
    added_tokens = _qwen3_5_added_tokens(tokenizer_json, config)
    if model is None or added_tokens is None:
        return None
    settings = _without_vocabulary(tokenizer_json)
    if settings.truncation is not None or settings.padding is not None:
        return None  # transformers keeps them on the rebuilt backend: not reproduced
    post_processor = settings.post_processor

    named: dict[str, str | AddedToken] = {}
    for name in NAMED_SPECIAL_TOKENS:
        value = config[name] if name in config else QWEN3_5_DEFAULT_SPECIAL_TOKENS.get(name)
        if value is None:
            continue
        converted = _special_value(value)
        if converted is None:
            return None
        named[name] = converted
    by_text = {token.content: token for token in added_tokens.values()}
    if by_text:  # a standard named token listed among the added tokens is that AddedToken (its flags)
        named = {name: by_text.get(str(value), value) for name, value in named.items()}
    model_specific = _model_specific_tokens(config)
    if model_specific is None:
        return None
    named.update(model_specific)
    if isinstance(config.get("extra_special_tokens"), dict) and config["extra_special_tokens"]:
        extras_given = config.get("additional_special_tokens") or []  # the dict named tokens; the list is this
    else:
        extras_given = _extra_special_values(config) or []
    if not isinstance(extras_given, (list, tuple)):
        return None
    extras: list[str | AddedToken] = []
    for value in extras_given:
        converted = _special_value(value)
        if converted is None:
            return None
        extras.append(converted)

    backend = Tokenizer(model)
    backend.decoder = decoders.ByteLevel()
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN3_5_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=bool(add_prefix_space), use_regex=False),
    ])
    if post_processor:
        backend.post_processor = post_processor
    backend.encode_special_tokens = split_special_tokens

    to_add: list[str | AddedToken] = [token for _, token in sorted(added_tokens.items(), key=lambda item: item[0])]
    listed = {token.content for token in to_add}
    for value in [*named.values(), *extras]:
        if str(value) not in listed and value not in to_add:
            to_add.append(value)
    named_texts = {str(value) for value in named.values()}
    tokens: list[AddedToken] = []
    for value in to_add:
        if isinstance(value, str):
            value = AddedToken(value, special=True)
        elif not value.special and value.content in named_texts:
            value.special = True
        tokens.append(value)
    if tokens:
        backend.add_tokens(tokens)
    if backend.post_processor is None:
        backend.post_processor = _plain_post_processor()
    return backend, {name: str(value) for name, value in named.items()}, [str(value) for value in extras]
