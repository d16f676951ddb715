"""Load a hybrid model through transformers and expose the parts the runtime drives.

We reuse the model's own modules and weights (embeddings, norms, projections, MLPs / MoE blocks, rotary
embedding, LM head); only the mixer paths that must expose states, transition operators, conv tails and
pre-RoPE keys are re-implemented (`mixers/`). Which family a model is, and how its layers become blocks, is the
family adapter's business (`families/`, registered by `config.model_type`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hypic_rag.errors import EXIT_BAD_INPUT, HypicError
from hypic_rag.runtime.blocks import Block
from hypic_rag.runtime.families import Family, family_for, supported_model_types, text_backbone
from hypic_rag.runtime.fast_linear import fast_view

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = supported_model_types()
"""Every `config.model_type` a registered family serves."""


DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""Weight dtypes a model may be loaded in (`--dtype`), by name."""

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
"""Weight files `from_pretrained` reads, single-file or sharded with an index."""

TOKENIZER_FILES = (("tokenizer.json",), ("vocab.json", "merges.txt"), ("tokenizer.model",), ("vocab.txt",))
"""File sets any one of which holds a tokenizer's vocabulary."""


class ModelLoadError(HypicError, ValueError):
    """A model that cannot be loaded: the message is one line saying what is wrong and what to fix (exit code 2;
    still a ValueError)."""

    exit_code = EXIT_BAD_INPUT


class UnsupportedModelError(ModelLoadError):
    """The checkpoint is not a hybrid family this runtime knows."""


def dtype_name(dtype: torch.dtype) -> str:
    """The name of `dtype` as in `DTYPES` ("float32" for torch.float32)."""
    return str(dtype).removeprefix("torch.")


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    """A torch dtype from a name of `DTYPES` (or a dtype); None stays None. ValueError for any other."""
    if dtype is None or isinstance(dtype, torch.dtype):
        if isinstance(dtype, torch.dtype) and dtype not in DTYPES.values():
            raise ValueError(f"dtype {dtype_name(dtype)} is not supported; choose one of {', '.join(DTYPES)}")
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype!r} is not supported; choose one of {', '.join(DTYPES)}") from None


@dataclass(slots=True)
class HybridModel:
    """A loaded hybrid causal LM and the handles the runtime needs.

    hf_model: the transformers model as it was given (or as `load_model` loaded it), never changed by the runtime:
    its own forward is transformers' stock forward; or, for a natively built checkpoint (`implementation`
    "native", `runtime.native`), the module tree of the same names and weights, which has no forward of its own.
    runtime_model: what the runtime drives, `fast_view(hf_model)`: the same parameters and buffers (shared, not
    copied), its plain linear layers `FastLinear`, in eval mode.
    blocks[i]: decoder layer i as a `Block` (its mixers over runtime_model's modules), built by `family`;
    layer_types[i]: its kind ("linear_attention", "full_attention", both joined by "+", or "mlp").
    fingerprint: sha256 over the config and a digest of the weights (cache keys use it).
    tokenizer_fingerprint: sha256 of the tokenizer's serialised form ("none" without a tokenizer).
    """

    hf_model: nn.Module
    runtime_model: nn.Module
    config: Any
    tokenizer: Any | None
    layer_types: tuple[str, ...]
    fingerprint: str
    tokenizer_fingerprint: str
    family: Family
    blocks: tuple[Block, ...]

    @property
    def implementation(self) -> str:
        """"native" when `runtime.native` built the modules (no transformers forward), else "transformers"."""
        return "native" if getattr(self.hf_model, "native", False) else "transformers"

    @property
    def backbone(self) -> nn.Module:
        """The decoder stack the runtime drives (embeddings, layers, final norm); the language model of a multimodal
        model."""
        return self.family.backbone(self.runtime_model)

    @property
    def layers(self) -> nn.ModuleList:
        """The model's own decoder layers (the runtime drives `blocks`, built over them)."""
        return self.backbone.layers

    @property
    def device(self) -> torch.device:
        return self.hf_model.get_input_embeddings().weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.hf_model.get_input_embeddings().weight.dtype

    @property
    def dtype_name(self) -> str:
        """The weights' dtype by name: "float32", "bfloat16" or "float16"."""
        return dtype_name(self.dtype)

    @property
    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.hf_model, "generation_config", None), self.config):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return ids

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings as the family computes them: ids [...] -> [..., hidden]."""
        return self.family.embed(self.runtime_model, ids)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: hidden [T, hidden] -> logits [T, vocab] (float32)."""
        return self.family.logits(self.runtime_model, hidden)


def text_stack_tensors(hf_model: nn.Module) -> dict[str, torch.Tensor]:
    """The text stack's weights under the names a text-only checkpoint uses (`model.*`, `lm_head.*`).

    A multimodal model's vision tower (and anything else outside the decoder and its head) is left out, so a
    `Qwen3_5ForConditionalGeneration` and the `Qwen3_5ForCausalLM` loaded from the same checkpoint give the same
    tensors.
    """
    tensors = {f"model.{name}": tensor for name, tensor in text_backbone(hf_model).state_dict().items()}
    tensors.update({f"lm_head.{name}": tensor for name, tensor in hf_model.lm_head.state_dict().items()})
    return tensors


def _raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor on its device (copied only when not contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _byte_checksum(raw: torch.Tensor) -> str:
    """Exact checksum of `raw` (uint8 [N]): the sum modulo 2**64 of its 8-byte words (native byte order), and its
    0-7 tail bytes.

    Integer addition modulo 2**64 is exact, associative and commutative, so (unlike a float sum) the result does
    not depend on how many threads reduce it, in which order, or on which device; int64 sums run at memory speed.
    """
    whole = raw.numel() // 8 * 8
    words = raw[:whole]
    if whole and words.data_ptr() % 8:
        words = words.clone()  # an int64 view needs 8-byte alignment
    total = int(words.view(torch.int64).sum()) if whole else 0
    return f"{total}:{bytes(raw[whole:].cpu().tolist()).hex()}"


def weights_digest(weights: nn.Module | dict[str, torch.Tensor], samples_per_tensor: int = 1024) -> str:
    """sha256 over every tensor's name, shape, dtype, a strided sample of its raw bytes and an exact checksum of
    all its bytes (`weights`: a module, whose state dict is digested, or named tensors).

    Exact: it depends on the bytes only, never on torch's thread count or device (docs/families.md, "Upgrading").
    The sample catches moved
    values, the checksum a change anywhere; hashing every byte of a 70 GB checkpoint would cost minutes, the
    checksum costs one pass at memory speed.
    """
    tensors = weights.state_dict() if isinstance(weights, nn.Module) else weights
    digest = hashlib.sha256()
    for name, tensor in sorted(tensors.items()):
        flat = tensor.detach().reshape(-1)
        stride = max(1, flat.numel() // samples_per_tensor)
        sample = _raw_bytes(flat[::stride][:samples_per_tensor]).cpu()
        digest.update(f"{name}|{tuple(tensor.shape)}|{tensor.dtype}|".encode())
        digest.update(sample.numpy().tobytes())
        digest.update(f"|{_byte_checksum(_raw_bytes(tensor))}|".encode())
    return digest.hexdigest()


CONFIG_DIGEST_IGNORED = (
    "transformers_version", "_name_or_path", "_attn_implementation_autoset", "dtype", "torch_dtype",
    "output_hidden_states", "output_attentions", "return_dict", "chunk_size_feed_forward", "is_encoder_decoder",
    "id2label", "label2id", "problem_type",
)
"""Config keys outside the fingerprint: where and by which version a config was written, and the settings every
transformers config carries that do not change a causal LM's outputs (a natively read config.json lacks them)."""


def config_digest(config: Any) -> str:
    """sha256 of the config's values but `CONFIG_DIGEST_IGNORED`."""
    data = config.to_dict()
    for ignored in CONFIG_DIGEST_IGNORED:
        data.pop(ignored, None)
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()


def tokenizer_digest(tokenizer: Any | None) -> str:
    if tokenizer is None:
        return "none"
    backend = getattr(tokenizer, "backend_tokenizer", None)
    serialised = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    extra = json.dumps({"special": tokenizer.all_special_tokens}, sort_keys=True)
    return hashlib.sha256((serialised + extra).encode()).hexdigest()


def _text_config(config: Any) -> Any:
    return getattr(config, "text_config", None) or config


def _check_supported(config: Any, family: Family | None = None) -> Family:
    """The family serving `config` (`family` when given), or `UnsupportedModelError` saying why there is none."""
    model_type = getattr(config, "model_type", None)
    family = family or family_for(model_type)
    if family is None:
        raise UnsupportedModelError(
            f"model type {model_type!r} is not supported; supported: {', '.join(supported_model_types())}"
        )
    reason = family.unsupported_reason(config)
    if reason is not None:
        raise UnsupportedModelError(reason)
    return family


def wrap_model(hf_model: nn.Module, tokenizer: Any | None = None, *, family: Family | None = None) -> HybridModel:
    """Wrap an already-built transformers causal LM, leaving it as it was (its classes, modules, training flag and
    weights): the runtime drives `fast_view(hf_model)`, in eval mode, over the same parameter tensors.

    hf_model: a text model (`Qwen3_5ForCausalLM`, ...) or a multimodal one (`Qwen3_5ForConditionalGeneration`,
    ...), whose text stack (`model.language_model`, `lm_head`) the runtime drives. The fingerprint covers the text
    config and the text stack's weights only, so both forms of one checkpoint get the same fingerprint.
    family: the adapter to build the blocks with (default: the one registered for the config's model type).
    """
    config = _text_config(hf_model.config)
    family = _check_supported(config, family)
    problem = family.structure_problem(hf_model)
    if problem is not None:
        raise UnsupportedModelError(problem)
    # oneDNN for CPU float32 linears (the few rows of batched decode, `fast_linear`), on a view: the caller's
    # object keeps its own nn.Linear layers, so its forward stays transformers' own
    runtime_model = fast_view(hf_model).eval()
    try:
        blocks = family.build_blocks(runtime_model)
    except ValueError as error:
        raise UnsupportedModelError(f"cannot drive {type(hf_model).__name__}: {error}") from error
    layer_types = tuple(block.layer_type for block in blocks)
    # a model on the meta device has shapes but no weights (`encode.entry_layout`): its fingerprint is the config's
    on_meta = any(parameter.is_meta for parameter in hf_model.parameters())
    weights = "meta" if on_meta else weights_digest(text_stack_tensors(hf_model))
    fingerprint = hashlib.sha256((config_digest(config) + weights).encode()).hexdigest()
    return HybridModel(
        hf_model=hf_model,
        runtime_model=runtime_model,
        config=config,
        tokenizer=tokenizer,
        layer_types=layer_types,
        fingerprint=fingerprint,
        tokenizer_fingerprint=tokenizer_digest(tokenizer),
        family=family,
        blocks=blocks,
    )


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def has_tokenizer_files(path: Path) -> bool:
    """Whether `path` holds one of the `TOKENIZER_FILES` sets."""
    return any(all((path / name).is_file() for name in names) for names in TOKENIZER_FILES)


def check_model_directory(path: str | Path, *, require_tokenizer: bool = True) -> Path:
    """Cheap checks of a checkpoint directory before anything is loaded or created; returns the path.

    Raises `ModelLoadError` with one line naming the problem: no such directory, no or invalid config.json, no
    weights (or a shard named in the index file missing), no tokenizer files (when `require_tokenizer`).
    """
    path = Path(path).expanduser()
    config_file = path / "config.json"
    if not path.is_dir() or not config_file.is_file():
        raise ModelLoadError(f"model directory {str(path)!r} does not exist or has no config.json")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelLoadError(f"{config_file} is not valid JSON ({error}); restore the checkpoint's config.json") from None
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelLoadError(f"{config_file} has no model_type; restore the checkpoint's config.json")
    weights = [name for name in WEIGHT_FILES if (path / name).is_file()]
    if not weights:
        raise ModelLoadError(
            f"model directory {str(path)!r} has no weights ({' or '.join(WEIGHT_FILES[::2])}, or a sharded "
            "checkpoint with its .index.json); copy the checkpoint's weight files into it"
        )
    if weights[0].endswith(".index.json"):
        index_file = path / weights[0]
        try:
            shards = set(json.loads(index_file.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise ModelLoadError(f"{index_file} is not a valid weight index ({_first_line(error)})") from None
        missing = sorted(shard for shard in shards if not (path / str(shard)).is_file())
        if missing:
            raise ModelLoadError(f"{index_file} names {len(missing)} missing weight file(s), e.g. {missing[0]}")
    if require_tokenizer and not has_tokenizer_files(path):
        raise ModelLoadError(
            f"model directory {str(path)!r} has no tokenizer files (tokenizer.json, or vocab.json and merges.txt); "
            "copy the checkpoint's tokenizer files into it"
        )
    return path


def load_model(
    source: str | Path | nn.Module | Any, *, device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None, tokenizer: Any | None = None, require_tokenizer: bool = False,
    implementation: str = "auto",
) -> HybridModel:
    """Load a hybrid model.

    source: a local checkpoint directory (config, safetensors, tokenizer; a text-only or a multimodal checkpoint,
    single-file or sharded), an instantiated transformers model (a causal LM or a multimodal
    `...ForConditionalGeneration`, whose text stack is used), or a transformers config (random weights). Never
    downloads: a missing directory is an error.
    device: defaults to CUDA when available, else CPU. dtype: a torch dtype or a name of `DTYPES`; defaults to
    float32 on CPU, bfloat16 on CUDA. require_tokenizer: a directory without tokenizer files is an error (else it
    loads with `tokenizer=None`). A directory that cannot be loaded raises `ModelLoadError` (one line).
    implementation (directories only): "auto" builds the modules natively, without importing transformers, when
    `runtime.native` reproduces the checkpoint exactly (Qwen3.5 dense, the bundled model's family), else through
    transformers; "native" requires the native build; "transformers" always uses transformers' model classes (for
    transformers' own forward on `hf_model`). Both give the same blocks, outputs and fingerprint.

    A transformers model object is used where it is, as it is: it is never moved, converted or modified (its
    modules keep their classes, its forward stays transformers' own; the runtime drives a view over the same
    weights, `wrap_model`), and nothing is copied. Its device and dtype are the defaults; naming another device or
    dtype than the object's raises `ModelLoadError` (convert it first: ``model.to(device, dtype)``).
    """
    from hypic_rag.runtime.checkpoints.native import IMPLEMENTATIONS

    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation {implementation!r} is not one of {', '.join(IMPLEMENTATIONS)}")
    if isinstance(source, nn.Module):
        return wrap_model(_as_given(source, device, resolve_dtype(dtype)), tokenizer=tokenizer)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    dtype = resolve_dtype(dtype)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    if not isinstance(source, (str, Path)):  # a transformers config: random weights
        from transformers import AutoModelForCausalLM

        _check_supported(_text_config(source))
        model = AutoModelForCausalLM.from_config(source, dtype=dtype)
        return wrap_model(model.to(device=device, dtype=dtype), tokenizer=tokenizer)

    path = check_model_directory(source, require_tokenizer=require_tokenizer and tokenizer is None)
    model = _native_modules(path, device, dtype, implementation)
    if model is None:
        model = _transformers_modules(path, device, dtype)
    if tokenizer is None:
        tokenizer = _directory_tokenizer(path, require_tokenizer, implementation)
    return wrap_model(model, tokenizer=tokenizer)


LOAD_ERRORS: tuple[type[BaseException], ...] = (
    OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, RuntimeError,
)
"""What building a model from a damaged or inconsistent checkpoint raises (json, safetensors, transformers' config
validation, a config naming more layers than `layer_types` holds, ...): `load_model` turns each into one
`ModelLoadError` line."""


def _native_modules(path: Path, device: torch.device, dtype: torch.dtype, implementation: str) -> nn.Module | None:
    """The checkpoint's modules built by `runtime.native`, or None when it does not build them and `implementation`
    allows transformers ("auto"; "native" raises `ModelLoadError` saying why)."""
    if implementation == "transformers":
        return None
    from safetensors import SafetensorError

    from hypic_rag.runtime.checkpoints.native import load_native, unsupported_reason

    reason = unsupported_reason(path)
    if reason is not None:
        if implementation == "native":
            raise ModelLoadError(f"the model in {str(path)!r} has no native implementation here: {reason}")
        logger.info("loading %s through transformers (the native build would not equal it: %s)", path, reason)
        return None
    try:
        return load_native(path, device=device, dtype=dtype,
                           on_missing=lambda missing: missing_weights_error(path, missing)).model
    except ModelLoadError:  # weights lacking a declared tensor
        raise
    except (*LOAD_ERRORS, SafetensorError) as error:  # a damaged file
        raise ModelLoadError(f"cannot load the model in {str(path)!r}: {_first_line(error)}") from error


def _transformers_modules(path: Path, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The checkpoint loaded with transformers' model classes, on `device` in `dtype`. A checkpoint whose weights
    lack a tensor of a declared layer is refused (transformers would initialise it at random)."""
    from huggingface_hub.errors import StrictDataclassError
    from safetensors import SafetensorError
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # loading is quick for our sizes; keep CLI output clean
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        _check_supported(_text_config(config))
        model, loading = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, local_files_only=True, output_loading_info=True)
    except ModelLoadError:
        raise
    except (*LOAD_ERRORS, SafetensorError, StrictDataclassError) as error:  # a damaged file, a config it rejects
        raise ModelLoadError(f"cannot load the model in {str(path)!r}: {_first_line(error)}") from error
    parameters = dict(model.named_parameters())  # a buffer left out is computed at construction, not drawn at random
    missing = sorted(name for name in loading.get("missing_keys") or () if name in parameters)
    if missing:
        raise missing_weights_error(path, missing)
    return model.to(device=device, dtype=dtype)


def missing_weights_error(path: Path, missing: list[str]) -> ModelLoadError:
    """The one-line error for a checkpoint whose weights lack `missing` (sorted names), whichever build found it."""
    more = f" and {len(missing) - 1} more tensors" if len(missing) > 1 else ""
    return ModelLoadError(
        f"the weights in {str(path)!r} lack {missing[0]}{more} of the layers config.json declares; restore the "
        "checkpoint's weight files (or its config.json)"
    )


def _directory_tokenizer(path: Path, require_tokenizer: bool, implementation: str) -> Any | None:
    """The tokenizer in `path` (None, with a warning, when it has none or it cannot be read and none is required):
    `runtime.tokenizer`'s when it reproduces transformers' exactly and `implementation` is not "transformers", else
    transformers' `AutoTokenizer`."""
    if not has_tokenizer_files(path):
        logger.warning("no tokenizer files in %s; loaded without a tokenizer", path)
        return None
    if implementation != "transformers":
        from hypic_rag.runtime.checkpoints.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(path)
        if tokenizer is not None:
            return tokenizer
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as error:
        if require_tokenizer:
            raise ModelLoadError(f"cannot load the tokenizer in {str(path)!r}: {_first_line(error)}") from error
        logger.warning("no tokenizer loaded from %s: %s", path, error)
        return None


def _as_given(model: nn.Module, device: str | torch.device | None, dtype: torch.dtype | None) -> nn.Module:
    """`model` itself when `device` and `dtype` (None: any) are where and what its weights are; else
    `ModelLoadError` saying to convert it first (loading never moves or converts a caller's object)."""
    embeddings = getattr(model, "get_input_embeddings", None)
    if embeddings is None:  # not a transformers model: `wrap_model` says what is wrong with it
        return model
    weight = embeddings().weight
    wanted_device = torch.device(device) if device is not None else weight.device
    if wanted_device.type == weight.device.type and wanted_device.index in (None, weight.device.index):
        wanted_device = weight.device
    if wanted_device != weight.device or (dtype is not None and dtype != weight.dtype):
        wanted = f"{wanted_device} {dtype_name(dtype or weight.dtype)}"
        raise ModelLoadError(
            f"the model given is {weight.device} {dtype_name(weight.dtype)}, not {wanted}; load_model uses a model "
            f"object as it is: convert it first (model.to(device, dtype)) or pass the device and dtype it has"
        )
    return model
