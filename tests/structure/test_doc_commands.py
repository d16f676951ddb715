"""Every command line in the README's and the docs' code blocks and inline code is one the tools accept as written.

A `hypic-rag ...` line is parsed by the CLI's own parser (`build_parser`), once with its optional `[...]` parts left
out and once with them in (the first alternative of `a|b`), its upper-case placeholders (`DIR`, `N`, `URL`, ...)
given sample values: a renamed option, a removed command or a value outside an option's choices fails here. A
`python -m MODULE ...` line names a module that exists and options that module (or its package) defines; `make T`
a target of the Makefile; `scripts/...` a script that exists and defines the options used. The Python blocks are
run by their own tests (README: tests/e2e/test_docs_and_examples.py; docs/llama_index.md:
tests/integrations/test_llama_index_docs.py; docs/service.md: tests/server/test_server_retrieval_stage.py).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import itertools
import re
import shlex
from pathlib import Path

import pytest

from hypic_rag.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
SHELL_INFO = {"", "bash", "sh", "shell", "console"}

PLACEHOLDERS = {
    "DIR": "some-dir", "CORPUS": "corpus", "PATH": "some-path", "FILE": "questions.txt", "N": "2", "K": "2",
    "M": "4", "C": "1", "D": "float32", "MODE": "hypic", "TYPE": "jamba", "MODEL_TYPE": "jamba",
    "URL": "http://127.0.0.1:9000", "ADDRESS": "auto", "SIZE": "1G", "LIST": "modes", "SPECS": "seam,budget:2",
    "BUCKET": "my-bucket", "PREFIX": "hypic",
}
"""Sample values of the placeholders the docs write in upper case (a new placeholder must be added here)."""

ALTERNATIVES_LIMIT = 64


def fenced_blocks(text: str) -> list[tuple[str, int, str]]:
    """(info string, first line number, body) of every ``` block of a markdown text."""
    blocks, info, start, body = [], None, 0, []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("```"):
            if info is None:
                info, start, body = line[3:].strip(), number + 1, []
            else:
                blocks.append((info, start, "\n".join(body)))
                info = None
        elif info is not None:
            body.append(line)
    return blocks


def command_lines(body: str) -> list[str]:
    """The logical lines of a shell block: comments cut, `\\`-continued and indented continuation lines joined,
    leading environment assignments dropped, a pipeline reduced to its part that runs one of our tools."""
    logical: list[str] = []
    for raw in body.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", raw).rstrip()
        if not line.strip():
            continue
        if logical and (logical[-1].endswith("\\") or raw[:1].isspace()):
            logical[-1] = logical[-1].rstrip("\\").rstrip() + " " + line.strip()
        else:
            logical.append(line.strip())
    commands = []
    for line in logical:
        for part in re.split(r"\s\|\s", line):
            part = re.sub(r"^(\w+=\S*\s+)+", "", part.strip())
            if part.startswith(("hypic-rag", "python -m ", "make ", "scripts/")):
                commands.append(part)
    return commands


def inline_commands(text: str) -> list[tuple[int, str]]:
    """(line number, command) of the `hypic-rag ...` and `python -m ...` code spans of the prose (outside blocks;
    leading environment assignments dropped)."""
    found, fenced = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            found += [(number, span) for span in re.findall(r"`(?:\w+=\S*\s+)*((?:hypic-rag|python -m) [^`]+)`", line)]
    return found


def documented_commands() -> list[tuple[str, str, bool]]:
    """(where, command, whole) for every tool invocation in the README's and the docs' shell blocks (whole: a
    command line to run) and inline code (a mention: a command's name and the options it is given)."""
    found = []
    for document in DOCUMENTS:
        text = document.read_text(encoding="utf-8")
        name = document.relative_to(ROOT)
        for info, line, body in fenced_blocks(text):
            if info in SHELL_INFO:
                found += [(f"{name}:{line}", command, True) for command in command_lines(body)]
        found += [(f"{name}:{line}", " ".join(span.split()), False) for line, span in inline_commands(text)
                  if "<" not in span]  # `hypic-rag <command>: error: ...` shows a message's form
    return found


def optional_variants(command: str) -> list[str]:
    """The command without its `[...]` parts and with them (innermost first; the first alternative of `a|b`)."""
    without, with_ = command, command
    group = re.compile(r"\[([^\[\]]*)\]")
    while group.search(without):
        without = group.sub("", without)
    while group.search(with_):
        with_ = group.sub(lambda match: match.group(1).split("|")[0], with_)
    return list(dict.fromkeys([" ".join(without.split()), " ".join(with_.split())]))


def argument_lists(command: str) -> list[list[str]]:
    """Every argv a `hypic-rag` line stands for: optional parts out and in, each alternative of a bare `a|b|c`
    token, placeholders replaced by sample values."""
    argvs = []
    for variant in optional_variants(command):
        tokens = shlex.split(variant)[1:]
        choices = [token.split("|") if "|" in token and not token.startswith("-") else [token] for token in tokens]
        for chosen in itertools.islice(itertools.product(*choices), ALTERNATIVES_LIMIT):
            argvs.append([re.sub(r"\b[A-Z][A-Z_]*\b", lambda word: PLACEHOLDERS.get(word.group(0), word.group(0)), token)
                          for token in chosen])
    return argvs


def parse_error(argv: list[str]) -> str | None:
    """None if the CLI's parser accepts ARGV (`--help` and `--version` exit 0), else what it said."""
    stderr = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
        try:
            build_parser().parse_args(argv)
        except SystemExit as exit_:
            return None if exit_.code in (0, None) else stderr.getvalue().strip() or f"exit {exit_.code}"
    return None


def parser_options(parser: argparse.ArgumentParser) -> set[str]:
    """The option strings PARSER and its nested sub-commands accept."""
    options = set()
    for action in parser._actions:
        options |= set(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                options |= parser_options(child)
    return options


def subcommand_options(name: str) -> set[str]:
    """The option strings the CLI's sub-command NAME (and its own sub-commands) accept."""
    parser = build_parser()
    [subparsers] = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    assert name in subparsers.choices, f"no command `hypic-rag {name}`"
    return parser_options(subparsers.choices[name])


def module_source_text(module: str) -> str:
    """The source of MODULE and the other modules of its package (where its options may be defined)."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"no module {module}"
    origin = Path(spec.origin)
    files = {origin, *origin.parent.glob("*.py")}
    return "\n".join(path.read_text(encoding="utf-8") for path in sorted(files))


def options_of(command: str) -> list[str]:
    return sorted(set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", command)))


COMMANDS = documented_commands()


def test_the_docs_have_commands_to_check() -> None:
    tools = {command.split()[0] for _, command, _ in COMMANDS}
    assert {"hypic-rag", "python", "make"} <= tools, tools
    assert len(COMMANDS) > 30


@pytest.mark.parametrize(("where", "command", "whole"), COMMANDS, ids=[where for where, _, _ in COMMANDS])
def test_a_documented_command_is_accepted_as_written(where: str, command: str, whole: bool) -> None:
    if command.startswith("hypic-rag") and not whole:  # a mention: the command exists and knows its options
        first = (shlex.split(command)[1:2] or ["-"])[0].rstrip(":,.")
        if first.startswith("-") or first.isupper():  # `hypic-rag --version`, `hypic-rag COMMAND --help`
            known = [parser_options(build_parser())]
        else:
            known = [subcommand_options(name) for name in first.split("|")]
        for options in known:
            missing = [option for option in options_of(command) if option not in options]
            assert not missing, f"{where}: `{command}`: no option {missing}"
    elif command.startswith("hypic-rag"):
        words = shlex.split(re.sub(r"[\[\]|]", " ", command))
        unknown = sorted({word for word in words if re.fullmatch(r"[A-Z][A-Z_]*", word) and word not in PLACEHOLDERS})
        assert not unknown, f"{where}: placeholders without a sample value: {unknown} (add them to PLACEHOLDERS)"
        if " ... " in f" {command} ":  # `hypic-rag ask|serve ... --option X`: the options each command must know
            for name in shlex.split(command)[1].split("|"):
                missing = [option for option in options_of(command) if option not in subcommand_options(name)]
                assert not missing, f"{where}: `hypic-rag {name}` has no {missing}"
            return
        for argv in argument_lists(command):
            error = parse_error(argv)
            assert error is None, f"{where}: `hypic-rag {' '.join(argv)}` is refused: {error}"
    elif command.startswith("python -m "):
        module = command.split()[2]
        source = module_source_text(module)
        missing = [option for option in options_of(command) if f'"{option}"' not in source]
        assert not missing, f"{where}: `python -m {module}` defines no {missing}"
    elif command.startswith("make "):
        targets = re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(encoding="utf-8"), flags=re.MULTILINE)
        assert command.split()[1] in targets, f"{where}: no Makefile target {command.split()[1]!r}"
    else:
        script = ROOT / command.split()[0]
        assert script.is_file(), f"{where}: no script {script.relative_to(ROOT)}"
        text = script.read_text(encoding="utf-8")
        missing = [option for option in options_of(command) if option not in text]
        assert not missing, f"{where}: {script.name} knows no {missing}"


def test_the_check_finds_a_renamed_option_and_a_missing_module() -> None:
    """The checks above can fail: an option the CLI lacks, a value outside its choices, a module that is gone."""
    assert parse_error(["ask", "--index", "some-dir", "q", "--top-kk", "2"]) is not None
    assert parse_error(["bench", "--profile", "enormous"]) is not None
    assert parse_error(["ask", "--index", "some-dir", "q", "--top-k", "2"]) is None
    assert "--top-k" in subcommand_options("ask") and "--top-kk" not in subcommand_options("ask")
    with pytest.raises(AssertionError, match="no module"):
        module_source_text("evals.no_such_evaluation")
    assert inline_commands("Run `PYTHONPATH=tests python -m kits.service_page out.png` once.") == [
        (1, "python -m kits.service_page out.png")]
    assert command_lines("OMP_WAIT_POLICY=PASSIVE hypic-rag bench \\\n    --quick   # note\necho q | hypic-rag ask -") == [
        "hypic-rag bench --quick", "hypic-rag ask -"]
    assert optional_variants("hypic-rag ask --index DIR [--top-k K [--json]]") == [
        "hypic-rag ask --index DIR", "hypic-rag ask --index DIR --top-k K --json"]
