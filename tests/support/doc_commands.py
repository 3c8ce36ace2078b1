"""The commands the docs show, found in their Markdown: `rlinf-pipe ...` and `bash examples/...` command lines in
fenced code blocks and inline code spans, and the `plan` output blocks (a fenced block whose first line is
`$ rlinf-pipe plan ...`, its output below it). Used by tests/unit/test_docs.py; no rlinf_pipe imports."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

PROGRAMS = ("rlinf-pipe", ".venv/bin/rlinf-pipe")
SUBCOMMANDS = ("plan", "rehearse", "train", "eval", "convert", "timeline")
PROMPT = "$ "
ELISION = "..."
"""A line of exactly this in an output block stands for any number of lines of the real output (none included)."""

_ENV_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
_OPERATORS = ("&&", "||", ";", "|", "&")
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")


@dataclass(frozen=True)
class DocCommand:
    """One command line as a doc shows it: where (`file:line`), its text (continuations joined), its words once the
    placeholders are substituted, and whether it heads an output block (then the output test runs it)."""

    file: str
    line: int
    text: str
    words: tuple[str, ...]
    placeholders: tuple[str, ...] = ()
    in_output_block: bool = False

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def kind(self) -> str:
        """`rlinf-pipe` or `bash` (a script under examples/)."""
        return "bash" if self.words[0] == "bash" else "rlinf-pipe"

    @property
    def args(self) -> list[str]:
        """The words after the program (`rlinf-pipe`) or after the script (`bash examples/...sh`)."""
        return list(self.words[2:] if self.kind == "bash" else self.words[1:])

    def __str__(self) -> str:
        return f"{self.where}: `{self.text}`"


@dataclass
class OutputBlock:
    """A `$ rlinf-pipe plan ...` line of a fenced block and the output shown under it (up to the next `$ ` line)."""

    command: DocCommand
    expected: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Fenced:
    line: int  # 1-based line of the opening fence
    info: str
    lines: tuple[str, ...]


def fenced_blocks(text: str) -> tuple[list[Fenced], str]:
    """The fenced code blocks of a Markdown text, and the text with every fenced line blanked (line numbers kept)."""
    blocks: list[Fenced] = []
    prose: list[str] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            prose.append(lines[i])
            i += 1
            continue
        fence, info = match.group(1), match.group(2).strip()
        start, body = i, []
        i += 1
        while i < len(lines) and not re.match(rf"^ {{0,3}}{fence[0]}{{{len(fence)},}}\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        blocks.append(Fenced(start + 1, info, tuple(body)))
        prose.extend([""] * (i - start + 1))
        i += 1
    return blocks, "\n".join(prose[: len(lines)])


def inline_spans(prose: str) -> list[tuple[int, str]]:
    """(line, content) of every inline code span of Markdown prose (fenced blocks blanked): a run of backticks up to
    the next run of the same length, within one paragraph; line breaks inside a span read as spaces."""
    spans = []
    pos = 0
    while True:
        opening = re.compile(r"`+").search(prose, pos)
        if opening is None:
            return spans
        ticks = opening.group(0)
        closing = re.compile(rf"(?<!`){ticks}(?!`)").search(prose, opening.end())
        paragraph_end = prose.find("\n\n", opening.end())
        if closing is None or (paragraph_end != -1 and closing.start() > paragraph_end):
            pos = opening.end()
            continue
        content = prose[opening.end():closing.start()]
        content = re.sub(r"\s*\n\s*", " ", content).strip()
        spans.append((prose.count("\n", 0, opening.start()) + 1, content))
        pos = closing.end()


def join_continuations(lines: list[str], start: int) -> list[tuple[int, str]]:
    """(line, text) of the logical lines of a shell block: a line ending in `\\` continues on the next."""
    out: list[tuple[int, str]] = []
    pending: tuple[int, str] | None = None
    for offset, line in enumerate(lines):
        number = start + offset
        if pending is not None:
            number, line = pending[0], pending[1] + " " + line.strip()
            pending = None
        if line.rstrip().endswith("\\"):
            pending = (number, line.rstrip()[:-1].rstrip())
            continue
        out.append((number, line))
    if pending is not None:
        out.append(pending)
    return out


def _mentions_a_command(text: str) -> bool:
    return any(program in text for program in PROGRAMS) or "bash examples/" in text


def split_commands(text: str) -> list[list[str]]:
    """The simple commands of one shell line (split at `&&`, `||`, `;`, `|`, `&`; comments dropped), as words, with
    leading environment assignments (`RANK=0 ...`) left out. A `ValueError` for text shlex cannot split."""
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    commands: list[list[str]] = [[]]
    for word in lexer:
        if word in _OPERATORS:
            commands.append([])
        else:
            commands[-1].append(word)
    out = []
    for words in commands:
        while words and _ENV_ASSIGNMENT.match(words[0]) and len(words) > 1:
            words = words[1:]
        if words:
            out.append(words)
    return out


def is_our_command(words: list[str]) -> bool:
    if words[0] in PROGRAMS:
        return True
    return words[0] == "bash" and len(words) > 1 and words[1].startswith("examples/")


def is_a_name(words: list[str]) -> bool:
    """`rlinf-pipe`, `rlinf-pipe plan`: the prose naming a command, not a command line to run."""
    return words[0] in PROGRAMS and (len(words) == 1 or (len(words) == 2 and words[1] in SUBCOMMANDS))


def substitute(text: str, placeholders: dict[str, str]) -> tuple[str, tuple[str, ...]]:
    """`text` with each documented placeholder replaced, and which were."""
    used = []
    for placeholder, value in placeholders.items():
        if placeholder in text:
            text = text.replace(placeholder, value)
            used.append(placeholder)
    return text, tuple(used)


def commands_of_line(file: str, number: int, text: str, placeholders: dict[str, str],
                     in_output_block: bool = False) -> list[DocCommand]:
    """Our commands on one logical line or span (none for a line that only names a command)."""
    if not _mentions_a_command(text):
        return []
    shown = text.strip()
    if shown.startswith(PROMPT):
        shown = shown[len(PROMPT):]
    substituted, used = substitute(shown, placeholders)
    try:
        simple = split_commands(substituted)
    except ValueError as exc:  # (fine in a line that only mentions a command, e.g. a message quoting one)
        starts = re.match(r"([A-Za-z_][A-Za-z0-9_]*=\S*\s+)*(\.venv/bin/)?(rlinf-pipe|bash examples/)", substituted)
        if starts:
            raise AssertionError(f"{file}:{number}: `{shown}` is not a command line shlex can split ({exc})") from None
        return []
    found = []
    for words in simple:
        if is_our_command(words) and not is_a_name(words):
            display = shown if len(simple) == 1 else " ".join(words)
            found.append(DocCommand(file, number, display, tuple(words), used, in_output_block))
    return found


def doc_commands(path: Path, root: Path, placeholders: dict[str, str]) -> tuple[list[DocCommand], list[OutputBlock]]:
    """Every command a Markdown file shows (fenced blocks, then inline spans), and its `$ rlinf-pipe` output blocks."""
    file = str(path.relative_to(root))
    blocks, prose = fenced_blocks(path.read_text())
    commands: list[DocCommand] = []
    outputs: list[OutputBlock] = []
    for block in blocks:
        body = list(block.lines)
        if body and body[0].startswith(PROMPT + "rlinf-pipe "):
            outputs.extend(_output_block(file, block, placeholders))
            continue
        for number, line in join_continuations(body, block.line + 1):
            commands.extend(commands_of_line(file, number, line, placeholders))
    for number, span in inline_spans(prose):
        commands.extend(commands_of_line(file, number, span, placeholders))
    for output in outputs:
        commands.append(output.command)
    return commands, outputs


def _output_block(file: str, block: Fenced, placeholders: dict[str, str]) -> list[OutputBlock]:
    """The `$ ` commands of an output block, each with the lines shown under it."""
    out: list[OutputBlock] = []
    lines = list(block.lines)
    i = 0
    while i < len(lines):
        number = block.line + 1 + i
        if lines[i].startswith(PROMPT):
            text = lines[i]
            while text.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                text = text.rstrip()[:-1].rstrip() + " " + lines[i].strip()
            found = commands_of_line(file, number, text, placeholders, in_output_block=True)
            if len(found) != 1:
                raise AssertionError(f"{file}:{number}: an output block's `$ ` line must be one rlinf-pipe command, "
                                     f"got `{text}`")
            out.append(OutputBlock(found[0]))
        elif not out:
            raise AssertionError(f"{file}:{number}: output before the block's first `$ ` command")
        else:
            out[-1].expected.append(lines[i].rstrip())
        i += 1
    for block_out in out:
        while block_out.expected and not block_out.expected[-1]:
            block_out.expected.pop()
    return out


def matches(expected: list[str], actual: list[str]) -> bool:
    """Whether `actual` is `expected` line for line, an `...` line of `expected` standing for any lines."""
    memo: dict[tuple[int, int], bool] = {}

    def match(i: int, j: int) -> bool:
        if (i, j) not in memo:
            if i == len(expected):
                result = j == len(actual)
            elif expected[i] == ELISION:
                result = match(i + 1, j) or (j < len(actual) and match(i, j + 1))
            else:
                result = j < len(actual) and expected[i] == actual[j] and match(i + 1, j + 1)
            memo[i, j] = result
        return memo[i, j]

    return match(0, 0)
