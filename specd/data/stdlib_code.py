"""The `code` domain: Python standard library source, cut into function- and class-sized chunks.

Design choices:

- **Source of truth is the running interpreter's stdlib** (`sysconfig.get_paths()["stdlib"]`), so any
  machine with CPython 3.11 builds the same corpus without a download. Files are listed sorted and
  split with a seeded shuffle, which makes the result independent of directory iteration order.
- **Excluded:** third-party packages, test suites, GUI/demo/legacy-tool packages, and generated data
  tables (codec maps, entity tables, sysconfig dumps, the pydoc topic dump that the dialogue domain
  uses). Tables teach a small model to loop on one pattern, which is the failure we want to avoid.
- **Chunks follow the module's top-level structure** (`ast`): each def/class is a chunk, together with
  the comment lines directly above it; runs of other statements form one chunk. An oversized class is
  chunked the same way one level down (header, then each method); anything still too long is cut at
  blank lines into pieces of at most `MAX_CHUNK_LINES`. The license block that opens many files is
  dropped, and identical chunks are kept once.
- **Held-out is file-level:** a tenth of the files never contributes training text. Prompts are
  functions from those files (methods dedented), cut after the signature and the first docstring line.
"""

from __future__ import annotations

import ast
import random
import sysconfig
import textwrap
from dataclasses import dataclass
from pathlib import Path

from specd.data.corpus import Corpus, HeldoutPrompt, drop_leaked

__all__ = ["build_code_corpus", "chunk_module", "list_stdlib_files", "normalize_code", "read_source"]

# Directory names skipped anywhere in a path.
_EXCLUDED_PARTS = frozenset({
    "site-packages", "test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo", "ensurepip",
    "__pycache__", "encodings", "pydoc_data", "__phello__",
})
# Generated tables rather than code (see module docstring).
_EXCLUDED_FILES = frozenset({"html/entities.py", "stringprep.py", "__hello__.py"})

MAX_CHUNK_LINES = 60
MAX_CHUNK_CHARS = 3000
HELDOUT_FILE_FRACTION = 0.1
NUM_HELDOUT_PROMPTS = 80
# Held-out functions between these sizes (in lines) give a prompt and a reference of useful length.
_MIN_FUNCTION_LINES = 6
_MAX_FUNCTION_LINES = 50


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_stdlib_files() -> list[Path]:
    """Top-level stdlib modules and packages as a sorted list of `.py` paths (relative to the root)."""
    root = stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root)
        parts = relative.parts
        if any(part in _EXCLUDED_PARTS for part in parts) or relative.as_posix() in _EXCLUDED_FILES:
            continue
        # config-3.11-<platform>/ holds build scripts; _sysconfigdata_* is a generated dict dump.
        if parts[0].startswith("config-") or relative.name.startswith("_sysconfigdata"):
            continue
        files.append(relative)
    return files


def read_source(relative: Path) -> tuple[list[str], ast.Module] | None:
    """Lines (right-stripped, form feeds removed) and the parse tree of one stdlib file.

    Returns None for a file that is not valid 3.11 source (none should be, but a patched
    distribution may ship one).
    """
    raw = (stdlib_root() / relative).read_bytes()
    try:
        source = raw.decode("utf-8")
        tree = ast.parse(source)
    except (UnicodeDecodeError, SyntaxError, ValueError):
        return None
    # Split on "\n" only: str.splitlines also breaks at form feeds, which would shift the line
    # numbers away from the ones `ast` reports.
    source = source.replace("\r\n", "\n").replace("\r", "\n")
    lines = [line.replace("\x0c", "").rstrip() for line in source.split("\n")]
    return lines, tree


def _first_line(node: ast.stmt) -> int:
    """0-based first line of a statement, decorators included."""
    decorators = getattr(node, "decorator_list", [])
    return min([node.lineno] + [decorator.lineno for decorator in decorators]) - 1


def _is_definition(node: ast.stmt) -> bool:
    return isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))


def _header_end(lines: list[str]) -> int:
    # The opening comment block (shebang, coding line, license) is boilerplate repeated across files.
    index = 0
    while index < len(lines) and (not lines[index] or lines[index].lstrip().startswith("#")):
        index += 1
    return index


def _split_oversized(block: list[str]) -> list[list[str]]:
    """Cut a block at blank lines into pieces within the line and character bounds."""
    if len(block) <= MAX_CHUNK_LINES and sum(map(len, block)) <= MAX_CHUNK_CHARS:
        return [block]
    pieces: list[list[str]] = []
    current: list[str] = []
    for line in block:
        too_long = len(current) >= MAX_CHUNK_LINES or sum(map(len, current)) + len(line) > MAX_CHUNK_CHARS
        # Prefer a blank-line boundary once the piece is half full; cut hard only at the limit.
        if current and ((not line and len(current) >= MAX_CHUNK_LINES // 2) or too_long):
            pieces.append(current)
            current = []
        if current or line:
            current.append(line)
    if current:
        pieces.append(current)
    return pieces


def _segments(lines: list[str], nodes: list[ast.stmt], *, floor: int, end: int) -> list[tuple[int, int, ast.stmt]]:
    """(start, end, first node) of each definition and of each run of other statements in `nodes`."""
    starts: list[int] = []
    owners: list[ast.stmt] = []
    previous_was_definition = True
    for node in nodes:
        definition = _is_definition(node)
        if definition or previous_was_definition:
            start = _first_line(node)
            # Comments directly above a definition describe it: move them into its chunk.
            while start - 1 >= floor and lines[start - 1].lstrip().startswith("#"):
                start -= 1
            starts.append(max(start, floor))
            owners.append(node)
        previous_was_definition = definition
    return list(zip(starts, starts[1:] + [end], owners))


def _pieces(lines: list[str], start: int, end: int, node: ast.stmt) -> list[list[str]]:
    block = lines[start:end]
    while block and not block[-1]:
        block.pop()
    end = start + len(block)
    fits = len(block) <= MAX_CHUNK_LINES and sum(map(len, block)) <= MAX_CHUNK_CHARS
    if fits or not isinstance(node, ast.ClassDef):
        return _split_oversized(block)
    # A large class splits like a module: its header (class line, docstring, attributes) and each
    # method become chunks, so no chunk starts in the middle of a method.
    segments = _segments(lines, node.body, floor=start, end=end)
    segments[0] = (start, segments[0][1], segments[0][2])
    return [piece for segment in segments for piece in _pieces(lines, *segment)]


def chunk_module(lines: list[str], tree: ast.Module) -> list[str]:
    """Chunks of one module, in file order."""
    chunks = []
    for start, end, node in _segments(lines, tree.body, floor=_header_end(lines), end=len(lines)):
        for piece in _pieces(lines, start, end, node):
            text = "\n".join(piece).strip("\n")
            # A lone import or constant carries no structure worth a document.
            if text.count("\n") >= 1 or len(text) >= 60:
                chunks.append(text + "\n")
    return chunks


@dataclass(kw_only=True, slots=True)
class _FunctionSplit:
    prompt: str
    reference: str


def _split_function(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> _FunctionSplit | None:
    """Cut one function after its signature and the first line of its docstring."""
    start, end = _first_line(node), node.end_lineno
    if not _MIN_FUNCTION_LINES <= end - start <= _MAX_FUNCTION_LINES:
        return None
    first = node.body[0]
    if first.lineno - 1 <= node.lineno - 1:
        return None  # body on the def line: nothing to cut
    has_docstring = (
        isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
    )
    # Lines of the prompt, counted from `start`: the signature, plus the docstring's first line.
    num_prompt_lines = first.lineno - 1 - start + (1 if has_docstring else 0)
    text_lines = textwrap.dedent("\n".join(lines[start:end])).split("\n")
    prompt_lines, reference_lines = text_lines[:num_prompt_lines], text_lines[num_prompt_lines:]
    if sum(1 for line in reference_lines if line.strip()) < 3:
        return None
    split = _FunctionSplit(prompt="\n".join(prompt_lines) + "\n", reference="\n".join(reference_lines) + "\n")
    try:
        # A method whose docstring is less indented than its body cannot be dedented into valid code.
        ast.parse(split.prompt + split.reference)
    except SyntaxError:
        return None
    return split


def normalize_code(text: str) -> str:
    """Non-blank lines without indentation: equal for a method and its dedented copy."""
    return "\n".join(line.strip() for line in text.split("\n") if line.strip())


def _heldout_functions(relative: Path) -> list[_FunctionSplit]:
    parsed = read_source(relative)
    if parsed is None:
        return []
    lines, tree = parsed
    splits = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            split = _split_function(lines, node)
            if split is not None:
                splits.append(split)
    return splits


def build_code_corpus(*, seed: int, max_train_chars: int) -> Corpus:
    files = list_stdlib_files()
    random.Random(f"code-split-{seed}").shuffle(files)
    num_heldout_files = max(1, round(len(files) * HELDOUT_FILE_FRACTION))
    heldout_files, train_files = files[:num_heldout_files], files[num_heldout_files:]

    train: list[str] = []
    seen: set[str] = set()
    total = 0
    for relative in train_files:
        parsed = read_source(relative)
        if parsed is None:
            continue
        for chunk in chunk_module(*parsed):
            if chunk in seen or total + len(chunk) > max_train_chars:
                continue
            seen.add(chunk)
            train.append(chunk)
            total += len(chunk)
        if total >= max_train_chars - 60:
            break

    # Round-robin over the held-out files so the prompts are not dominated by a few large modules.
    rng = random.Random(f"code-heldout-{seed}")
    per_file = []
    for relative in heldout_files:
        splits = _heldout_functions(relative)
        rng.shuffle(splits)
        per_file.append(splits)
    candidates: list[HeldoutPrompt] = []
    for depth in range(max(map(len, per_file), default=0)):
        candidates.extend(
            HeldoutPrompt(domain="code", prompt=splits[depth].prompt, reference=splits[depth].reference)
            for splits in per_file
            if depth < len(splits)
        )
    # The file split cannot see code copied between files (_pyio and friends): compare bodies with
    # indentation removed, since held-out methods are dedented.
    normalized_train = "\0".join(normalize_code(chunk) for chunk in train)
    candidates = [item for item in candidates if normalize_code(item.reference) not in normalized_train]
    # dict.fromkeys dedupes (the dataclass is frozen, so hashable) and keeps the order.
    heldout = drop_leaked(list(dict.fromkeys(candidates)), train)[:NUM_HELDOUT_PROMPTS]
    return Corpus(domain="code", train=train, heldout=heldout)
