"""The training loop of the default model: seeded, resumable from the run directory, with a document curriculum.

Run directory layout: `settings.json`, `tokenizer/`, `checkpoint.pt` (model, optimizer, step; rewritten
atomically every `checkpoint_every` steps), `metrics.jsonl` (loss and validation exact match), `train.log`.
Training data is a pure function of (run seed, step), so a resumed run sees the same batches as an unbroken one.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from training.data.cross_chunk_qa import sample_cross_chunk_context
from training.block_layout import BlockLayout, block_layout_logits, build_layout
from training.evaluate import EvalItem, greedy_answer, heldout_cases, prompt_ids, summarize
from training.model_config import ModelShape, build_config
from training.packing import ContextSpec, PackedExample, SegmentEncoder, collate, pack_example, sample_training_context
from training.tokenizer import train_tokenizer

logger = logging.getLogger(__name__)

TRAIN_WORLD_SEED_STRIDE = 10_000_000
"""Training worlds of run seed r use world seeds in [r * stride + 1, (r + 1) * stride)."""
VALIDATION_SEED = 500_000_000
"""Worlds used for the validation exact match printed during training."""


@dataclass
class TrainSettings:
    """Everything that defines a training run (saved as settings.json in the run directory)."""

    seed: int = 0
    total_steps: int = 1100
    batch_size: int = 8
    learning_rate: float = 3e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.05
    grad_clip: float = 1.0
    questions_per_context: int = 16
    two_hop_share: float = 0.25
    hard_negative_share: float = 0.0
    final_documents: int = 8
    curriculum_steps: int = 250
    answer_weight: float = 1.0
    text_weight: float = 0.2
    recap_documents: int = 1
    copy_warmup_steps: int = 180
    qk_norm_gain: float = 2.0
    qk_norm_lr_scale: float = 5.0
    copy_length: int = 40
    copy_batch_size: int = 16
    recap_weight: float = 0.5
    max_documents_override: int = 0
    eval_every: int = 100
    eval_questions: int = 48
    checkpoint_every: int = 25
    max_minutes: float | None = None
    stop_at_step: int = 0
    """Stop at this step (0: at total_steps) without changing the schedule: how a stage cut short is replayed."""
    threads: int = 1
    block_layout_share: float = 0.0
    """Share of QA contexts trained in the cached layout (`block_layout.py`): chunk tokens after the seam window are
    encoded standalone and composed, as `hypic` serves them; the rest are fully attended."""
    block_seams: tuple[int, ...] = (8,)
    """Seam windows a cached-layout context draws from (one per context)."""
    cross_chunk_share: float = 0.0
    """Share of QA contexts drawn from the cross-chunk worlds (`data/cross_chunk_qa.py`: documents of two chunks,
    the second never naming its subject), fully attended like the others."""
    init_weights: str = ""
    """An exported model directory (`Trainer.export`'s layout, e.g. `evals/stage3_model`) whose weights and
    tokenizer start this run, with a fresh optimizer (`init_from` takes a run directory's checkpoint instead)."""
    init_from: str = ""
    """A run directory whose checkpoint (weights and optimizer moments) starts this run: a second training stage
    with its own seed (fresh worlds) and learning-rate schedule. Its tokenizer is reused."""
    shape: ModelShape = field(default_factory=ModelShape)

    @classmethod
    def from_json(cls, text: str) -> "TrainSettings":
        data = json.loads(text)
        data["shape"] = ModelShape(**data["shape"])
        if "block_seams" in data:
            data["block_seams"] = tuple(data["block_seams"])
        return cls(**data)

    def to_json(self) -> str:
        data = asdict(self)
        return json.dumps(data, indent=2)


def documents_at(settings: TrainSettings, step: int, rng: random.Random) -> int:
    """Curriculum: the most documents per context grows from 1 to `final_documents` over `curriculum_steps`;
    a context draws its count from the three values up to that maximum (afterwards from final-2 .. final+1)."""
    if settings.max_documents_override:
        return rng.randint(1, settings.max_documents_override)
    if step >= settings.curriculum_steps:
        return rng.randint(max(1, settings.final_documents - 2), settings.final_documents + 1)
    most = 1 + round((settings.final_documents - 1) * step / settings.curriculum_steps)
    return rng.randint(max(1, most - 2), most)


def copy_batch_at(settings: TrainSettings, step: int, vocab_size: int, first_id: int) -> list[PackedExample]:
    """A batch of the copy task: `copy_length` random tokens, then the same tokens again (loss on the repeat).

    Every repeated token is predictable only by finding its earlier occurrence and copying the token after it,
    so this dense signal builds the induction circuit that reading an answer out of a document needs."""
    generator = torch.Generator().manual_seed(settings.seed * 1_000_003 + step)
    examples = []
    for _ in range(settings.copy_batch_size):
        tokens = torch.randint(first_id, vocab_size, (settings.copy_length,), generator=generator)
        weights = torch.cat([torch.zeros(settings.copy_length), torch.ones(settings.copy_length)])
        examples.append(PackedExample(torch.cat([tokens, tokens]), weights, settings.copy_length))
    return examples


def batch_at(settings: TrainSettings, step: int, encoder: SegmentEncoder) -> list[PackedExample]:
    """The training batch of `step` (deterministic): the copy task during the copy warm-up, then QA contexts
    (the document curriculum counts from the end of the warm-up)."""
    if step < settings.copy_warmup_steps:
        return copy_batch_at(settings, step, len(encoder.tokenizer), first_id=len(encoder.tokenizer.all_special_ids))
    step -= settings.copy_warmup_steps
    rng = random.Random(f"batch-{settings.seed}-{step}")
    examples = []
    for index in range(settings.batch_size):
        world_seed = settings.seed * TRAIN_WORLD_SEED_STRIDE + 1 + step * settings.batch_size + index
        spec = ContextSpec(documents_at(settings, step, rng), settings.questions_per_context, settings.two_hop_share,
                           settings.hard_negative_share)
        if settings.cross_chunk_share > 0 and rng.random() < settings.cross_chunk_share:
            documents, questions = sample_cross_chunk_context(world_seed, max(2, (spec.num_documents + 1) // 2),
                                                              settings.questions_per_context)
        else:
            documents, questions = sample_training_context(world_seed, spec)
        recap = rng.sample(documents, min(settings.recap_documents, len(documents)))
        examples.append(pack_example(encoder, documents, questions, answer_weight=settings.answer_weight,
                                     text_weight=settings.text_weight, recap=recap, recap_weight=settings.recap_weight))
    return examples


def layout_at(settings: TrainSettings, step: int, examples: list[PackedExample], token_ids: torch.Tensor,
              pad_token_id: int) -> BlockLayout | None:
    """The cached layout of `step`'s batch (deterministic): each QA context is in the cached layout with probability
    `block_layout_share`, with a seam window drawn from `block_seams`. None when nothing is cached."""
    if settings.block_layout_share <= 0 or step < settings.copy_warmup_steps:
        return None
    rng = random.Random(f"layout-{settings.seed}-{step}")
    seams = [
        rng.choice(settings.block_seams) if rng.random() < settings.block_layout_share else None for _ in examples
    ]
    return build_layout(token_ids, [example.chunk_spans for example in examples], seams, pad_token_id)


def learning_rate_at(settings: TrainSettings, step: int) -> float:
    """Linear warm-up then cosine decay to `min_lr_ratio` of the peak at `total_steps`."""
    if step < settings.warmup_steps:
        return settings.learning_rate * (step + 1) / settings.warmup_steps
    progress = min(1.0, (step - settings.warmup_steps) / max(1, settings.total_steps - settings.warmup_steps))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return settings.learning_rate * (settings.min_lr_ratio + (1 - settings.min_lr_ratio) * cosine)


def weighted_loss(logits: torch.Tensor, token_ids: torch.Tensor, weights: torch.Tensor, answer_weight: float) -> tuple[torch.Tensor, float]:
    """logits [B, T, V], token_ids [B, T], weights [B, T]: weighted next-token cross entropy (scalar) and the mean
    cross entropy on answer tokens (for logging)."""
    targets = token_ids[:, 1:]
    target_weights = weights[:, 1:]
    token_loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    token_loss = token_loss.view_as(targets)
    loss = (token_loss * target_weights).sum() / target_weights.sum().clamp_min(1e-6)
    answer_mask = target_weights >= answer_weight
    answer_loss = float(token_loss.detach()[answer_mask].mean()) if answer_mask.any() else float("nan")
    return loss, answer_loss


def slow_decay_init(model: torch.nn.Module, seed: int) -> None:
    """Draw each linear layer's decay rate A log-uniform in [0.005, 2] (the default U(0.01, 16) makes most heads
    forget within a few tokens; slower heads can carry which entity a sentence is about)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "A_log") and hasattr(module, "dt_bias"):
                low, high = math.log(0.005), math.log(2.0)
                module.A_log.copy_(torch.rand(module.A_log.shape, generator=generator) * (high - low) + low)


def sharpen_attention_init(model: torch.nn.Module, gain: float) -> None:
    """Start the attention layers' q/k norm gains at `gain` instead of 1.

    q and k are RMS-normalised, so attention logits are bounded by the norm gains; from gain 1, Adam needs
    hundreds of steps to grow them enough for attention to single out one token among hundreds, and no
    lookup can be learned before that."""
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "q_norm") and hasattr(module, "k_norm"):
                for norm in (module.q_norm, module.k_norm):
                    norm.weight.fill_(gain - 1.0)  # zero-centred RMSNorm: the gain is 1 + weight


@torch.no_grad()
def validation_exact_match(model, encoder: SegmentEncoder, num_questions: int, num_chunks: int = 8) -> dict:
    """EM on `num_questions` validation questions (gold + distractor documents, `num_chunks` chunks)."""
    model.eval()
    items = [
        EvalItem(question, greedy_answer(model, encoder, prompt_ids(encoder, documents, question.text)))
        for _, question, documents in heldout_cases(VALIDATION_SEED, num_questions, num_chunks)
    ]
    model.train()
    return summarize(items)


@torch.no_grad()
def validation_cross_chunk(model, encoder: SegmentEncoder, num_questions: int) -> dict:
    """EM on `num_questions` cross-chunk validation questions (`validation_cross_chunk_cases`), fully attended: every
    question, and the cross-chunk ones apart."""
    model.eval()
    items = [(question.kind, EvalItem(question, greedy_answer(model, encoder, prompt_ids(encoder, chunks, question.text))))
             for chunks, question in validation_cross_chunk_cases(num_questions)]
    model.train()
    return {**summarize([item for _, item in items]),
            "cross_chunk_exact_match": summarize([item for kind, item in items if kind == "cross"])["exact_match"]}


def validation_cross_chunk_cases(num_questions: int, num_documents: int = 5) -> list[tuple[list, Any]]:
    """(chunks, question) pairs of the cross-chunk validation worlds (`VALIDATION_SEED` + 1,000,000 and on): each
    question's context is drawn as training's (`sample_cross_chunk_context`), its first question asked."""
    cases = []
    seed = VALIDATION_SEED + 1_000_000
    while len(cases) < num_questions:
        chunks, questions = sample_cross_chunk_context(seed, num_documents, 1)
        cases += [(chunks, question) for question in questions[:1]]
        seed += 1
    return cases


@torch.no_grad()
def validation_exact_match_hypic(model, encoder: SegmentEncoder, num_questions: int, seam_tokens: int = 8,
                                 num_chunks: int = 8) -> dict:
    """As `validation_exact_match`, answered by the runtime under `hypic` (standalone chunk entries, composed)."""
    from hypic_rag.runtime.engine import Engine
    from hypic_rag.runtime.model import wrap_model
    from hypic_rag.runtime.request import Request
    from hypic_rag.runtime.sampling import SamplingParams

    engine = Engine(wrap_model(model, encoder.tokenizer), seam_tokens=seam_tokens)  # sets eval mode
    params = SamplingParams(max_new_tokens=16, stop_strings=(encoder.prompt_format.answer_stop,))
    items = []
    for _, question, documents in heldout_cases(VALIDATION_SEED, num_questions, num_chunks):
        request = Request(list(encoder.prefix()), [encoder.chunk(d.text) for d in documents], encoder.question(question.text))
        items.append(EvalItem(question, engine.generate(request, mode="hypic", params=params).text.strip()))
    model.train()
    return summarize(items)


class Trainer:
    """Owns one run directory: creates it (tokenizer, settings) or resumes from its checkpoint."""

    def __init__(self, run_dir: str | Path, settings: TrainSettings | None = None) -> None:
        from transformers import PreTrainedTokenizerFast, Qwen3_5ForCausalLM

        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        settings_path = self.run_dir / "settings.json"
        if settings_path.exists():
            stored = TrainSettings.from_json(settings_path.read_text())
            if settings is not None and settings.max_minutes is not None:
                stored.max_minutes = settings.max_minutes
            if settings is not None and settings.stop_at_step:
                stored.stop_at_step = settings.stop_at_step
            self.settings = stored
        else:
            self.settings = settings or TrainSettings()
            if self.settings.init_from and not (Path(self.settings.init_from) / "checkpoint.pt").is_file():
                raise FileNotFoundError(f"init_from run {self.settings.init_from} has no checkpoint.pt")
            settings_path.write_text(self.settings.to_json())
        torch.manual_seed(self.settings.seed)
        tokenizer_dir = self.run_dir / "tokenizer"
        if not tokenizer_dir.exists():
            if self.settings.init_weights:
                tokenizer_dir.mkdir()
                for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                    if (Path(self.settings.init_weights) / name).is_file():
                        shutil.copy(Path(self.settings.init_weights) / name, tokenizer_dir / name)
            elif self.settings.init_from:
                shutil.copytree(Path(self.settings.init_from) / "tokenizer", tokenizer_dir)
            else:
                train_tokenizer().save_pretrained(tokenizer_dir)
        self.tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
        self.encoder = SegmentEncoder(self.tokenizer)
        config = build_config(self.settings.shape, len(self.tokenizer), eos_token_id=self.tokenizer.eos_token_id,
                              pad_token_id=self.tokenizer.pad_token_id)
        self.model = Qwen3_5ForCausalLM(config)
        slow_decay_init(self.model, self.settings.seed)
        sharpen_attention_init(self.model, self.settings.qk_norm_gain)
        decay, no_decay, qk_norms = [], [], []
        for name, parameter in self.model.named_parameters():
            if "q_norm" in name or "k_norm" in name:
                qk_norms.append(parameter)
            elif parameter.ndim < 2 or "norm" in name or "A_log" in name or "dt_bias" in name:
                no_decay.append(parameter)
            else:
                decay.append(parameter)
        self.optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.settings.weight_decay, "lr_scale": 1.0},
                {"params": no_decay, "weight_decay": 0.0, "lr_scale": 1.0},
                {"params": qk_norms, "weight_decay": 0.0, "lr_scale": self.settings.qk_norm_lr_scale},
            ],
            lr=self.settings.learning_rate, betas=(0.9, 0.95),
        )
        self.step = 0
        self.elapsed_seconds = 0.0
        self._load_checkpoint()

    @property
    def checkpoint_path(self) -> Path:
        return self.run_dir / "checkpoint.pt"

    def _load_checkpoint(self) -> None:
        if not self.checkpoint_path.exists():
            if self.settings.init_weights:
                from safetensors.torch import load_file

                weights = load_file(str(Path(self.settings.init_weights) / "model.safetensors"))
                missing, unexpected = self.model.load_state_dict(weights, strict=False)
                if unexpected or any("lm_head" not in name for name in missing):
                    raise ValueError(f"{self.settings.init_weights} does not fit this shape: missing {missing}, "
                                     f"unexpected {unexpected}")
                if "lm_head.weight" in missing:  # tied embeddings are saved once
                    self.model.tie_weights()
                logger.info("initialised %s from the weights of %s", self.run_dir, self.settings.init_weights)
            elif self.settings.init_from:
                source = Path(self.settings.init_from) / "checkpoint.pt"
                state = torch.load(source, map_location="cpu", weights_only=False)
                self.model.load_state_dict(state["model"])
                self.optimizer.load_state_dict(state["optimizer"])
                logger.info("initialised %s from %s (step %d of that run)", self.run_dir, source, state["step"])
            return
        state = torch.load(self.checkpoint_path, map_location="cpu", weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]
        self.elapsed_seconds = state.get("elapsed_seconds", 0.0)
        logger.info("resumed %s at step %d (%.1f min trained)", self.run_dir, self.step, self.elapsed_seconds / 60)

    def save_checkpoint(self) -> None:
        temporary = self.checkpoint_path.with_suffix(".tmp")
        torch.save({"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step,
                    "elapsed_seconds": self.elapsed_seconds}, temporary)
        os.replace(temporary, self.checkpoint_path)

    def _log_metrics(self, record: dict) -> None:
        with (self.run_dir / "metrics.jsonl").open("a") as handle:
            handle.write(json.dumps(record) + "\n")

    def train(self) -> None:
        """Train until `total_steps` (or `max_minutes` of this invocation), checkpointing as it goes."""
        settings = self.settings
        torch.set_num_threads(settings.threads)
        self.model.train()
        started = time.monotonic()
        progress = tqdm(total=settings.total_steps, initial=self.step, desc="train", dynamic_ncols=True, mininterval=10)
        running_loss, running_answer = None, None
        last_step = min(settings.total_steps, settings.stop_at_step or settings.total_steps)
        while self.step < last_step:
            if settings.max_minutes is not None and time.monotonic() - started > settings.max_minutes * 60:
                logger.info("time budget of %.1f min reached at step %d", settings.max_minutes, self.step)
                break
            step_started = time.monotonic()
            examples = batch_at(settings, self.step, self.encoder)
            token_ids, weights = collate(examples, self.tokenizer.pad_token_id)
            for group in self.optimizer.param_groups:
                group["lr"] = learning_rate_at(settings, self.step) * group.get("lr_scale", 1.0)
            layout = layout_at(settings, self.step, examples, token_ids, self.tokenizer.pad_token_id)
            if layout is None:
                logits = self.model(input_ids=token_ids, use_cache=False).logits
            else:
                logits = block_layout_logits(self.model, token_ids, layout)
                # a cached token's own prediction is made standalone: no loss on what it predicts here
                weights[:, 1:] = weights[:, 1:] * (~layout.cached[:, :-1]).float()
            loss, answer_loss = weighted_loss(logits, token_ids, weights, settings.answer_weight)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), settings.grad_clip)
            self.optimizer.step()
            self.step += 1
            self.elapsed_seconds += time.monotonic() - step_started
            loss_value = float(loss.detach())
            running_loss = loss_value if running_loss is None else 0.9 * running_loss + 0.1 * loss_value
            if not math.isnan(answer_loss):
                running_answer = answer_loss if running_answer is None else 0.9 * running_answer + 0.1 * answer_loss
            progress.update(1)
            progress.set_postfix(loss=f"{running_loss:.3f}", answer=f"{running_answer or 0:.3f}", T=token_ids.shape[1])
            record = {"step": self.step, "loss": loss_value, "answer_loss": answer_loss, "tokens": int(token_ids.numel()),
                      "lr": learning_rate_at(settings, self.step - 1), "minutes": self.elapsed_seconds / 60}
            if self.step % settings.eval_every == 0 or self.step == settings.total_steps:
                record["validation"] = validation_exact_match(self.model, self.encoder, settings.eval_questions)
                if settings.cross_chunk_share > 0:
                    record["validation_cross_chunk"] = validation_cross_chunk(self.model, self.encoder,
                                                                              settings.eval_questions)
                if settings.block_layout_share > 0:
                    record["validation_hypic"] = validation_exact_match_hypic(self.model, self.encoder, settings.eval_questions)
                logger.info("step %d: loss %.3f answer %.3f validation %s hypic %s", self.step, running_loss,
                            running_answer or 0, record["validation"], record.get("validation_hypic"))
            elif self.step % 10 == 0:
                logger.info("step %d: loss %.3f answer %.3f (%.1f min)", self.step, running_loss, running_answer or 0,
                            self.elapsed_seconds / 60)
            self._log_metrics(record)
            if self.step % settings.checkpoint_every == 0 or self.step == settings.total_steps:
                self.save_checkpoint()
        progress.close()
        self.save_checkpoint()

    def export(self, out_dir: str | Path) -> Path:
        """Write the trained model as a transformers checkpoint directory (safetensors, config, tokenizer)."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        self.model.eval()
        self.model.save_pretrained(out_dir, safe_serialization=True)
        self.tokenizer.save_pretrained(out_dir)
        (out_dir / "training_settings.json").write_text(self.settings.to_json())
        return out_dir
