"""The default model's trainer: a run split across invocations equals an unbroken one (weights and optimizer),
a second stage starts from the first stage's checkpoint and tokenizer, and hard-negative contexts hold more
confusable documents than random ones."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from training.data.synthetic_qa import generate_world
from training.model_config import ModelShape
from training.packing import ContextSpec, collate, sample_training_context
from training.trainer import Trainer, TrainSettings, batch_at, layout_at, validation_exact_match_hypic

TINY_SHAPE = ModelShape(hidden_size=32, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                        linear_value_head_dim=16, intermediate_size=64)


def tiny_settings(**changes) -> TrainSettings:
    values = dict(seed=3, total_steps=5, batch_size=2, copy_warmup_steps=2, copy_batch_size=2, copy_length=8,
                  curriculum_steps=2, final_documents=2, questions_per_context=3, eval_every=1000, eval_questions=2,
                  checkpoint_every=1000, threads=1, shape=TINY_SHAPE)
    values.update(changes)
    return TrainSettings(**values)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One trained tokenizer shared by every run of this module (training it is the slow part)."""
    from training.tokenizer import train_tokenizer

    directory = tmp_path_factory.mktemp("tokenizer") / "tokenizer"
    train_tokenizer(vocab_size=600, num_worlds=20).save_pretrained(directory)
    return directory


def new_run(root: Path, tokenizer_dir: Path, settings: TrainSettings) -> Trainer:
    root.mkdir(parents=True)
    shutil.copytree(tokenizer_dir, root / "tokenizer")
    return Trainer(root, settings)


def states_equal(first: dict, second: dict) -> bool:
    return first.keys() == second.keys() and all(torch.equal(first[name], second[name]) for name in first)


def test_resumed_run_equals_an_unbroken_one(tmp_path: Path, tokenizer_dir: Path) -> None:
    unbroken = new_run(tmp_path / "unbroken", tokenizer_dir, tiny_settings())
    unbroken.train()
    assert unbroken.step == 5

    split = new_run(tmp_path / "split", tokenizer_dir, tiny_settings(stop_at_step=3))
    split.train()
    assert split.step == 3
    resumed = Trainer(tmp_path / "split", tiny_settings(stop_at_step=5))  # a new process would do the same
    assert resumed.step == 3
    resumed.train()
    assert resumed.step == 5
    assert states_equal(unbroken.model.state_dict(), resumed.model.state_dict())
    first, second = unbroken.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert all(torch.equal(first[key]["exp_avg"], second[key]["exp_avg"]) for key in first)
    assert not states_equal(unbroken.model.state_dict(), Trainer(tmp_path / "fresh", tiny_settings()).model.state_dict())


def test_second_stage_starts_from_the_first_stage(tmp_path: Path, tokenizer_dir: Path) -> None:
    first = new_run(tmp_path / "stage1", tokenizer_dir, tiny_settings(total_steps=3))
    first.train()
    second = Trainer(tmp_path / "stage2", tiny_settings(seed=4, init_from=str(tmp_path / "stage1"), copy_warmup_steps=0,
                                                        total_steps=2))
    assert second.step == 0
    assert states_equal(first.model.state_dict(), second.model.state_dict())
    assert (tmp_path / "stage2" / "tokenizer" / "tokenizer.json").read_bytes() == (
        tmp_path / "stage1" / "tokenizer" / "tokenizer.json").read_bytes()
    second.train()
    assert second.step == 2
    assert not states_equal(first.model.state_dict(), second.model.state_dict())
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        Trainer(tmp_path / "stage3", tiny_settings(init_from=str(tmp_path / "missing")))
    assert not (tmp_path / "stage3" / "settings.json").exists()


def test_batches_are_a_function_of_seed_and_step(tmp_path: Path, tokenizer_dir: Path) -> None:
    trainer = new_run(tmp_path / "run", tokenizer_dir, tiny_settings(hard_negative_share=0.5))
    for step in (0, 4):
        first, again = batch_at(trainer.settings, step, trainer.encoder), batch_at(trainer.settings, step, trainer.encoder)
        assert all(torch.equal(a.token_ids, b.token_ids) and torch.equal(a.loss_weights, b.loss_weights) for a, b in zip(first, again))
    assert not torch.equal(batch_at(trainer.settings, 4, trainer.encoder)[0].token_ids,
                           batch_at(trainer.settings, 5, trainer.encoder)[0].token_ids)


def test_hard_negative_contexts_hold_more_documents_of_the_same_kind() -> None:
    def same_kind_share(hard_negative_share: float) -> float:
        shares = []
        for seed in range(1, 41):
            documents, questions = sample_training_context(seed, ContextSpec(8, 8, 0.25, hard_negative_share))
            world = generate_world(seed)
            kinds = [world.entity(document.entity_id).kind for document in documents]
            assert len(set(document.doc_id for document in documents)) == 8 and questions
            shares.append(max(kinds.count(kind) for kind in set(kinds)) / len(kinds))
        return sum(shares) / len(shares)

    assert same_kind_share(1.0) > same_kind_share(0.0) + 0.2


def test_cached_layout_stage_trains_and_resumes_exactly(tmp_path: Path, tokenizer_dir: Path) -> None:
    """A stage in the cached layout: chunks of some contexts are encoded standalone (`block_layout.py`); the layout
    of a step is a function of (seed, step), so a split run still equals an unbroken one; settings round-trip."""
    changes = dict(copy_warmup_steps=0, total_steps=3, block_layout_share=0.6, block_seams=(0, 2), final_documents=3)
    trainer = new_run(tmp_path / "run", tokenizer_dir, tiny_settings(**changes))
    examples = batch_at(trainer.settings, 1, trainer.encoder)
    assert all(len(example.chunk_spans) >= 1 for example in examples)
    token_ids, _ = collate(examples, trainer.tokenizer.pad_token_id)
    layouts = [layout_at(trainer.settings, step, batch_at(trainer.settings, step, trainer.encoder),
                         collate(batch_at(trainer.settings, step, trainer.encoder), 0)[0], 0) for step in range(6)]
    assert any(layout is not None for layout in layouts)
    again = layout_at(trainer.settings, 1, examples, token_ids, trainer.tokenizer.pad_token_id)
    first = layout_at(trainer.settings, 1, examples, token_ids, trainer.tokenizer.pad_token_id)
    assert (first is None) == (again is None)
    if first is not None:
        assert torch.equal(first.cached, again.cached) and torch.equal(first.documents, again.documents)
    assert layout_at(tiny_settings(), 1, examples, token_ids, 0) is None  # share 0: the ordinary forward
    trainer.train()
    assert trainer.step == 3
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(record["loss"]) for record in records)
    split = new_run(tmp_path / "split", tokenizer_dir, tiny_settings(**changes, stop_at_step=2))
    split.train()
    resumed = Trainer(tmp_path / "split", tiny_settings(**changes, stop_at_step=3))
    assert resumed.settings.block_seams == (0, 2) and resumed.settings.block_layout_share == 0.6
    resumed.train()
    assert states_equal(trainer.model.state_dict(), resumed.model.state_dict())
    summary = validation_exact_match_hypic(resumed.model, resumed.encoder, 3)  # answered by the runtime under hypic
    assert summary["num_questions"] == 3 and 0.0 <= summary["exact_match"] <= 1.0
    assert resumed.model.training  # back in training mode afterwards
