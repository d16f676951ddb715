"""A byte-level BPE tokenizer trained on the synthetic corpus (any text still encodes, byte by byte).

`add_prefix_space=True` makes a word at the start of a segment encode like the same word after a space, so an
entity name has one token id whether it opens a chunk, sits in a sentence, or is the answer after "Answer:".
The vocabulary is large enough that every invented name of the pools is a single token.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from training.data.name_pools import name_pools
from training.data.synthetic_qa import generate_questions, generate_world
from hypic_rag.prompting.layout import DEFAULT_PROMPT_FORMAT, PromptFormat

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def tokenizer_training_texts(num_worlds: int = 300, first_seed: int = 0, prompt_format: PromptFormat = DEFAULT_PROMPT_FORMAT) -> Iterator[str]:
    """Documents, questions and answers of `num_worlds` training worlds, plus the prompt templates' text."""
    yield prompt_format.prefix
    yield prompt_format.question("")
    for seed in range(first_seed, first_seed + num_worlds):
        world = generate_world(seed)
        for document in world.documents:
            yield prompt_format.chunk(document.text)
        for question in generate_questions(world, seed, 40, two_hop_share=0.3):
            yield prompt_format.question(question.text) + " " + question.answer + prompt_format.answer_stop


def train_tokenizer(vocab_size: int = 4096, num_worlds: int = 300):
    """Train the BPE tokenizer and wrap it as a transformers fast tokenizer (eos = pad = <|endoftext|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(tokenizer_training_texts(num_worlds)), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=SPECIAL_TOKENS[0],
        pad_token=SPECIAL_TOKENS[0],
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
    )
    split = [name for name in name_pools().all_names() if len(wrapped.encode(name, add_special_tokens=False)) > 1]
    logger.info("tokenizer: %d tokens; %d of %d pool names split into several tokens", len(wrapped), len(split),
                len(name_pools().all_names()))
    return wrapped
