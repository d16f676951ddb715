"""How a RAG request is laid out as segments: prefix, one segment per retrieved chunk, then the question.

Every segment is tokenized on its own (never as one concatenated string), so a chunk's token ids are the same
wherever it lands and its cached entry can be reused. Training data for the default model uses the same layout.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PromptFormat:
    """Text templates of the three kinds of segment.

    prefix: the fixed instruction at position 0 (cached like a chunk, always exact).
    chunk_template: formats one retrieved chunk's text; `{text}` is the chunk.
    question_template: the final segment; `{question}` is the user's question. The answer follows it.
    answer_stop: generation stops at this string (besides the tokenizer's end-of-sequence token).
    """

    prefix: str = "Answer the question from the documents.\n"
    chunk_template: str = "{text}\n"
    question_template: str = "Question: {question}\nAnswer:"
    answer_stop: str = "\n"

    def __post_init__(self) -> None:
        if "{text}" not in self.chunk_template:
            raise ValueError("chunk_template must contain '{text}'")
        if "{question}" not in self.question_template:
            raise ValueError("question_template must contain '{question}'")

    def chunk(self, text: str) -> str:
        return self.chunk_template.format(text=text)

    def question(self, question: str) -> str:
        return self.question_template.format(question=question)


DEFAULT_PROMPT_FORMAT = PromptFormat()
