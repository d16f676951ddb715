"""`hypic_rag.runtime.checkpoints.tokenizer` against transformers' AutoTokenizer on the same directories: the bundled model's
and layouts built here (a Qwen2-style byte-level BPE with added special tokens saved by transformers'
`save_pretrained`, its chat template in tokenizer_config.json; one whose tokenizer.json lacks the eos token and a
post-processor, with chat_template.jinja; Qwen3.5 checkpoints, for which AutoTokenizer builds `Qwen3_5Tokenizer`:
the dense and MoE published stand-ins of `hypic_rag.testing` and a hub-style one). Random strings, ids, chats; the
tokenizer digest; no transformers import."""

from __future__ import annotations

import copy
import json
import pickle
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from hypic_rag.demo.default_model import default_model_path
from hypic_rag.runtime.model import tokenizer_digest
from hypic_rag.runtime.checkpoints.tokenizer import (
    GENERIC_MODEL_TYPES,
    QWEN3_5_DECLARED_CLASSES,
    QWEN3_5_MODEL_TYPES,
    QWEN3_5_SPLIT_PATTERN,
    CheckpointTokenizer,
    load_tokenizer,
)
from kits.published import save_published_checkpoint

QWEN_STYLE_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}{{ eos_token|length }}"
)
TRAINING_TEXTS = [
    "The quick brown fox jumps over the lazy dog. Ünïcödé façade naïve café 東京 😀 123 456,789!",
    "def f(x):\n\treturn x  # comment\n\n\nprint('it''s')  we'll   see",
] * 20
PIECES = [
    "hello", " world", "  ", "\n", "\n\n", "\t", " \t ", "café", "e\u0301", "東京", "😀", "🇫🇷", "123", "4.5", "?!",
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|im_", "|>", "<tool>", "'s", "'LL", " ", "\u00a0", "\r\n",
    "Ω", "ß", "ﬁ", "\u200b", "x" * 40, "\\", '"', "{", "}",
]


def _random_texts(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    texts = ["", " ", "\n"]
    while len(texts) < count:
        texts.append("".join(rng.choice(PIECES) for _ in range(rng.randint(1, 12))))
    return texts


def _qwen_style_backend(extra_special: list[str], with_post_processor: bool, split: str = QWEN_STYLE_SPLIT):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=extra_special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(TRAINING_TEXTS, trainer=trainer)
    if with_post_processor:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    backend.add_tokens([AddedToken("<tool>", special=False, normalized=False)])
    return backend


@pytest.fixture(scope="module")
def qwen_style_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Special tokens in tokenizer.json, `additional_special_tokens`, chat template in tokenizer_config.json."""
    directory = tmp_path_factory.mktemp("qwen_style")
    backend = _qwen_style_backend(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], with_post_processor=True)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        extra_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    wrapped.save_pretrained(directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config["additional_special_tokens"] = config.pop("extra_special_tokens")
    config["errors"] = "replace"
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen3_next"}))
    return directory


@pytest.fixture(scope="module")
def sparse_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tokenizer.json without the eos token nor a post-processor (transformers adds both at load);
    chat_template.jinja; a bos token; granitemoehybrid."""
    directory = tmp_path_factory.mktemp("sparse")
    backend = _qwen_style_backend(["<|im_start|>"], with_post_processor=False)
    backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "TokenizersBackend", "eos_token": "</s>", "bos_token": "<s>", "pad_token": "</s>",
        "extra_special_tokens": ["<|im_start|>", "<|im_end|>"], "model_max_length": 64,
    }))
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE + "{{ bos_token }}")
    (directory / "config.json").write_text(json.dumps({"model_type": "granitemoehybrid"}))
    return directory


@pytest.fixture(scope="module")
def qwen3_5_published_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`hypic_rag.testing`'s dense Qwen3.5 stand-in: a plain byte-level tokenizer.json (GPT-2 regex, no NFC, the
    special tokens inside the BPE vocabulary), model type `qwen3_5`: AutoTokenizer rebuilds it as Qwen3.5's."""
    return save_published_checkpoint(tmp_path_factory.mktemp("qwen3_5"), TRAINING_TEXTS, kind="qwen3_5", shards=1)[0]


@pytest.fixture(scope="module")
def qwen3_5_moe_published_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("qwen3_5_moe")
    return save_published_checkpoint(directory, TRAINING_TEXTS, kind="qwen3_5_moe", shards=1)[0]


@pytest.fixture(scope="module")
def qwen3_5_hub_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer built the way the hub's Qwen3.5 one is: byte-level BPE with Qwen3.5's split regex and NFC, a
    ByteLevel post-processor, the special tokens added after the BPE vocabulary (`<think>` not special),
    tokenizer_config.json with `Qwen2Tokenizer`, `added_tokens_decoder`, eos `<|im_end|>`, null bos / unk,
    `additional_special_tokens`, model-specific named tokens (a dict `extra_special_tokens` and a `video_token` key
    whose token is in no file: transformers adds it), `errors`, `add_prefix_space`; vocab.json / merges.txt beside
    it; chat_template.jinja using a model-specific token."""
    from tokenizers import AddedToken

    directory = tmp_path_factory.mktemp("qwen3_5_hub")
    backend = _qwen_style_backend([], with_post_processor=True, split=QWEN3_5_SPLIT_PATTERN)
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|image_pad|>"]
    backend.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in special])
    backend.add_tokens([AddedToken(text, special=False, normalized=False) for text in ("<think>", "</think>")])
    backend.save(str(directory / "tokenizer.json"))
    backend.model.save(str(directory))  # vocab.json, merges.txt (transformers does not read them for Qwen3.5)
    decoder = {
        str(index): {"content": token.content, "lstrip": token.lstrip, "normalized": token.normalized,
                     "rstrip": token.rstrip, "single_word": token.single_word, "special": token.special}
        for index, token in backend.get_added_tokens_decoder().items()
    }
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": decoder,
        "additional_special_tokens": special[1:], "bos_token": None, "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>", "errors": "replace", "model_max_length": 262144, "pad_token": "<|endoftext|>",
        "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
        "video_token": "<|video_pad|>",
        "extra_special_tokens": {"image_token": "<|image_pad|>", "vision_bos_token": "<|vision_start|>"},
    }))
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE + "{{ image_token }}")
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "transformers_version": "4.57.0"}))
    return directory


@pytest.fixture(scope="module", params=[
    "bundled", "qwen_style", "sparse", "qwen3_5_published", "qwen3_5_moe_published", "qwen3_5_hub",
])
def pair(request: pytest.FixtureRequest) -> tuple[CheckpointTokenizer, object]:
    directory = default_model_path() if request.param == "bundled" else request.getfixturevalue(f"{request.param}_dir")
    ours = load_tokenizer(directory)
    assert isinstance(ours, CheckpointTokenizer), f"{request.param}: not loaded"
    return ours, AutoTokenizer.from_pretrained(directory, local_files_only=True)


def _model_type(tokenizer: CheckpointTokenizer) -> str:
    return json.loads((Path(tokenizer.name_or_path) / "config.json").read_text())["model_type"]


def test_loads_the_same_backend_and_special_tokens(pair) -> None:
    ours, theirs = pair
    rebuilt = _model_type(ours) in QWEN3_5_MODEL_TYPES
    assert type(theirs).__name__ == ("Qwen3_5Tokenizer" if rebuilt else "TokenizersBackend")
    assert ours.backend_tokenizer.to_str() == theirs.backend_tokenizer.to_str()
    assert tokenizer_digest(ours) == tokenizer_digest(theirs)
    assert ours.all_special_tokens == theirs.all_special_tokens
    assert ours.all_special_ids == theirs.all_special_ids
    assert ours.special_tokens_map == theirs.special_tokens_map
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        assert getattr(ours, name) == getattr(theirs, name), name
        assert getattr(ours, f"{name}_id") == getattr(theirs, f"{name}_id"), name
    assert len(ours) == len(theirs) and ours.vocab_size == theirs.vocab_size
    assert ours.get_vocab() == theirs.get_vocab()
    assert ours.chat_template == theirs.chat_template
    assert ours.model_max_length == theirs.model_max_length


def test_encodes_like_transformers(pair) -> None:
    ours, theirs = pair
    texts = _random_texts(seed=1, count=300)
    for special in (False, True):
        assert ours(texts, add_special_tokens=special, verbose=False) == dict(
            theirs(texts, add_special_tokens=special, verbose=False))
        assert ours(tuple(texts[:5]), add_special_tokens=special) == dict(
            theirs(tuple(texts[:5]), add_special_tokens=special))
    for text in texts[:120]:
        assert ours(text, add_special_tokens=False, verbose=False) == dict(
            theirs(text, add_special_tokens=False, verbose=False)), repr(text)
        mine = ours(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        reference = theirs(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        assert mine == dict(reference), repr(text)
        for special in (False, True):
            assert ours.encode(text, add_special_tokens=special, verbose=False) == theirs.encode(
                text, add_special_tokens=special, verbose=False), repr(text)
    batch = ours(texts[:50], add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    assert batch == dict(theirs(texts[:50], add_special_tokens=False, return_offsets_mapping=True, verbose=False))
    # the digest is the same after calls (transformers does not change its backend when encoding these)
    assert tokenizer_digest(ours) == tokenizer_digest(theirs)


def test_decodes_like_transformers(pair) -> None:
    ours, theirs = pair
    rng = random.Random(2)
    special_ids = [index for index in ours.all_special_ids if index is not None]
    for _ in range(300):
        ids = [rng.randrange(len(ours)) for _ in range(rng.randint(0, 20))]
        ids += rng.sample(special_ids, k=min(len(special_ids), rng.randint(0, 2)))
        rng.shuffle(ids)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), ids
    encoded = ours(_random_texts(seed=3, count=50), add_special_tokens=False)["input_ids"]
    assert ours.decode(encoded) == theirs.decode(encoded)  # a batch of sequences
    assert ours.decode(special_ids[0]) == theirs.decode(special_ids[0])  # one id


def test_chat_template_renders_like_transformers(pair) -> None:
    ours, theirs = pair
    if theirs.chat_template is None:
        with pytest.raises(ValueError):
            theirs.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
        with pytest.raises(ValueError):
            ours.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
        return
    rng = random.Random(4)
    for _ in range(20):
        messages = [{"role": rng.choice(["system", "user", "assistant"]), "content": text, "name": None}
                    for text in _random_texts(seed=rng.randrange(1000), count=rng.randint(4, 6))[3:]]
        for generation_prompt in (False, True):
            assert ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt) == (
                theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt))
        assert ours.apply_chat_template(messages, add_generation_prompt=True) == dict(
            theirs.apply_chat_template(messages, add_generation_prompt=True))


def test_copies_and_pickles(pair) -> None:
    ours, _ = pair
    texts = _random_texts(seed=5, count=40)
    for copied in (copy.deepcopy(ours), pickle.loads(pickle.dumps(ours))):
        assert copied.backend_tokenizer is not ours.backend_tokenizer
        assert copied(texts, add_special_tokens=False) == ours(texts, add_special_tokens=False)
        assert tokenizer_digest(copied) == tokenizer_digest(ours)


def test_project_uses_match(pair) -> None:
    """The project's own tokenizing helpers give the same result with either tokenizer."""
    from hypic_rag.prompting.chat import ChatMessage, chat_prompt
    from hypic_rag.prompting.layout import DEFAULT_PROMPT_FORMAT, tokenize_query, tokenize_segment
    from hypic_rag.retrieval.chunking import Chunker, ChunkerConfig
    from hypic_rag.retrieval.loading import Document

    ours, theirs = pair
    for text in _random_texts(seed=6, count=40):
        assert tokenize_segment(ours, text) == tokenize_segment(theirs, text)
        assert tokenize_query(ours, text + "?") == tokenize_query(theirs, text + "?")
    document = " ".join(_random_texts(seed=7, count=200)) + ("word " * 300)
    config = ChunkerConfig(chunk_tokens=24)
    chunks = [[chunk.text for chunk in Chunker(tokenizer, config, DEFAULT_PROMPT_FORMAT).chunk_document(
        Document(doc_id="d", text=document, source="d.txt"))] for tokenizer in (ours, theirs)]
    assert chunks[0] == chunks[1] and len(chunks[0]) > 3
    messages = [ChatMessage("user", ("Paris is in France.", "What is the capital?"))]
    assert chat_prompt(ours, messages, DEFAULT_PROMPT_FORMAT, None) == chat_prompt(theirs, messages,
                                                                                   DEFAULT_PROMPT_FORMAT, None)


def _copy_checkpoint(source: Path, target: Path) -> Path:
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors"))
    return target


def _edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("change", [
    "no_tokenizer_json", "class", "model_type", "unknown_key", "auto_map", "legacy_special_map", "truncation",
    "named_templates", "dict_extras", "no_config",
    "qwen3_5_class", "qwen3_5_model_specific_token", "qwen3_5_truncation", "qwen3_5_padding", "qwen3_5_word_level",
    "qwen3_5_plain_dict_token",
])
def test_returns_none_for_layouts_it_does_not_reproduce(
    tmp_path: Path, qwen_style_dir: Path, qwen3_5_hub_dir: Path, change: str
) -> None:
    source = qwen3_5_hub_dir if change.startswith("qwen3_5_") else qwen_style_dir
    directory = _copy_checkpoint(source, tmp_path / "checkpoint")
    assert load_tokenizer(directory) is not None
    config_file = directory / "tokenizer_config.json"
    if change == "no_tokenizer_json":
        (directory / "tokenizer.json").unlink()
    elif change == "class":
        _edit_json(config_file, tokenizer_class="Qwen2Tokenizer")
    elif change == "model_type":
        _edit_json(directory / "config.json", model_type="qwen2")  # AutoTokenizer builds Qwen2Tokenizer
    elif change == "unknown_key":
        _edit_json(config_file, image_token="<image>")
    elif change == "auto_map":
        _edit_json(config_file, auto_map={"AutoTokenizer": ["x.Tok", None]})
    elif change == "legacy_special_map":
        (directory / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<|im_start|>"}))
    elif change in ("truncation", "qwen3_5_truncation"):
        _edit_json(directory / "tokenizer.json", truncation={
            "direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0})
    elif change == "named_templates":
        (directory / "additional_chat_templates").mkdir()
        (directory / "additional_chat_templates" / "tool_use.jinja").write_text("{{ messages }}")
    elif change == "dict_extras":
        _edit_json(config_file, additional_special_tokens=None, extra_special_tokens={"image_token": "<|im_start|>"})
    elif change == "no_config":
        (directory / "config.json").unlink()
    elif change == "qwen3_5_class":
        _edit_json(config_file, tokenizer_class="GPT2Tokenizer")
    elif change == "qwen3_5_model_specific_token":
        _edit_json(config_file, audio_token={"content": "<|audio_pad|>"})  # transformers keeps it as a kwarg
    elif change == "qwen3_5_padding":
        _edit_json(directory / "tokenizer.json", padding={
            "strategy": "BatchLongest", "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
            "pad_type_id": 0, "pad_token": "<|endoftext|>"})
    elif change == "qwen3_5_word_level":
        tokenizer_json = json.loads((directory / "tokenizer.json").read_text())
        tokenizer_json["model"] = {"type": "WordLevel", "vocab": tokenizer_json["model"]["vocab"], "unk_token": "a"}
        (directory / "tokenizer.json").write_text(json.dumps(tokenizer_json))
    elif change == "qwen3_5_plain_dict_token":
        _edit_json(config_file, eos_token={"content": "<|im_end|>"})
    assert load_tokenizer(directory) is None


def test_model_type_table_matches_transformers(tmp_path: Path) -> None:
    """`GENERIC_MODEL_TYPES` and `QWEN3_5_MODEL_TYPES` match the installed transformers: a generic
    tokenizer_class stays TokenizersBackend for the former; the latter get `Qwen3_5Tokenizer` whatever
    `QWEN3_5_DECLARED_CLASSES` class they declare; `load_tokenizer` gives the same backend and special tokens for
    every one (the bundled model's files, rebuilt for Qwen3.5)."""
    source = default_model_path()
    cases = [(model_type, "TokenizersBackend") for model_type in sorted(GENERIC_MODEL_TYPES)]
    cases += [(model_type, declared) for model_type in sorted(QWEN3_5_MODEL_TYPES)
              for declared in sorted(QWEN3_5_DECLARED_CLASSES)]
    for model_type, declared in cases:
        directory = tmp_path / f"{model_type}-{declared}"
        directory.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(source / name, directory / name)
        _edit_json(directory / "tokenizer_config.json", tokenizer_class=declared)
        (directory / "config.json").write_text(json.dumps({"model_type": model_type}))
        theirs = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        expected = "Qwen3_5Tokenizer" if model_type in QWEN3_5_MODEL_TYPES else "TokenizersBackend"
        assert type(theirs).__name__ == expected, (model_type, declared)
        ours = load_tokenizer(directory)
        assert ours is not None, (model_type, declared)
        assert tokenizer_digest(ours) == tokenizer_digest(theirs), (model_type, declared)
        assert ours.special_tokens_map == theirs.special_tokens_map, (model_type, declared)
    assert QWEN3_5_MODEL_TYPES.isdisjoint(GENERIC_MODEL_TYPES)


def test_loading_and_tokenizing_imports_no_transformers() -> None:
    script = (
        "import sys\n"
        "from hypic_rag.demo.default_model import default_model_path\n"
        "from hypic_rag.runtime.checkpoints.tokenizer import load_tokenizer\n"
        "tokenizer = load_tokenizer(default_model_path())\n"
        "assert tokenizer is not None\n"
        "ids = tokenizer('hello world', add_special_tokens=False, verbose=False)['input_ids']\n"
        "assert tokenizer.decode(ids).strip() == 'hello world', tokenizer.decode(ids)\n"
        "print(sorted(name for name in ('transformers', 'torch', 'jinja2') if name in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", result.stdout + result.stderr  # jinja2 too: only a chat template loads it


def test_loading_a_qwen3_5_checkpoint_imports_no_transformers(qwen3_5_published_dir: Path) -> None:
    """`load_model` of a Qwen3.5 hub-layout checkpoint: native modules and this module's tokenizer, no transformers."""
    script = (
        "import sys\n"
        "from hypic_rag.runtime.model import load_model\n"
        "from hypic_rag.runtime.checkpoints.tokenizer import CheckpointTokenizer\n"
        f"model = load_model({str(qwen3_5_published_dir)!r}, device='cpu')\n"
        "assert model.implementation == 'native', model.implementation\n"
        "assert isinstance(model.tokenizer, CheckpointTokenizer), type(model.tokenizer)\n"
        "print('transformers' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False", result.stdout + result.stderr
