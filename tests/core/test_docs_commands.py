"""The commands README.md and docs/*.md name, run the way the docs say (issue 45, item 6).

Every command in a fenced block or an inline code span that starts (after ``VAR=value`` assignments
and ``bash``) with ``scripts/...``, ``megamoe`` or ``python -m megamoe_backend... | benchmarks...`` is found and:
- scripts/*.sh: exists (brace forms and globs expanded) and answers ``--help``; a full serve / bench
  invocation runs with ``--dry-run`` (the check against megamoe info off: CHECK=0), and every variable it
  assigns is one the script's ``--help`` lists; ``scripts/test.sh`` only ever gets ``--help``;
- ``megamoe ...``: its argv parses with the CLI's own parser (megamoe_backend.cli.main.build_parser),
  and each subcommand answers ``--help``;
- ``python -m megamoe_backend.X | benchmarks.X ...``: the module exists, its argv parses with its own add_arguments
  (the parser ``megamoe bench`` builds), and ``python -m X --help`` exits 0.
A synopsis (``[...]``, ``a | b``, ``...``, ``<...>``) is only checked for its command's ``--help``.
A command the doc keeps as history (a measurement of code that has since left the package) is marked
in the doc, on one of the three lines before it, with ``<!-- docs-test: skip: REASON -->``: it is
reported as skipped with that reason, never silently dropped. Nothing here needs a GPU or an engine.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ASSIGN = re.compile(r"^[A-Z_][A-Z0-9_]*=")
# a synopsis, not a command: [optional], a | b, ..., <placeholder>, {a|b}, or a bare metavar such as `--ep N`
SYNOPSIS = re.compile(r"\[|\]|\s\|\s|\.\.\.|<[^>]*>|\{[^}]*\||\s[A-Z][A-Z_]*(?=\s|$)")
SCRIPT = re.compile(r"^scripts/[\w{},*.-]+\.(sh|py)$")
SKIP_MARK = re.compile(r"<!-- docs-test: skip: (.+?) -->")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
SPAN = re.compile(r"`([^`]+)`")
MODULE_ROOTS = ("megamoe_backend", "benchmarks.")  # `python -m` modules the docs name: the package, the benches


@dataclass(frozen=True)
class Command:
    where: str  # "docs/serving.md:12"
    text: str
    skip: str | None = None  # the doc's reason when it marks the command as not runnable today

    @property
    def words(self) -> list[str]:
        return shlex.split(self.text)

    def split(self) -> tuple[dict[str, str], list[str]]:
        """(the VAR=value assignments before the command, the command's words; ``bash`` dropped)."""
        words, env = self.words, {}
        while words and ASSIGN.match(words[0]):
            name, value = words.pop(0).split("=", 1)
            env[name] = value
        if words[:1] == ["bash"]:
            words = words[1:]
        return env, words


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _is_command(words: list[str]) -> bool:
    while words and ASSIGN.match(words[0]):
        words = words[1:]
    if words[:1] == ["bash"]:
        words = words[1:]
    if not words:
        return False
    head = words[0]
    return (bool(SCRIPT.match(head)) or head == "megamoe" or head.endswith("bin/megamoe")
            or (len(words) > 2 and head.startswith("python") and words[1] == "-m" and words[2].startswith(MODULE_ROOTS)))


def _candidates(text: str, where: str, offset: int) -> list[Command]:
    out = []
    for piece in re.split(r"\s*(?:&&|;)\s*", text):
        piece = piece.split(" # ")[0].strip()
        try:
            words = shlex.split(piece)
        except ValueError:
            continue
        # `.venv/bin/pip install ... && .venv/bin/megamoe demo`: each part of a chain is its own command
        if _is_command(words):
            out.append(Command(f"{where}:{offset}", piece))
    return out


@lru_cache(maxsize=None)
def doc_commands(docs: tuple[Path, ...] = tuple(DOCS)) -> tuple[Command, ...]:
    found: list[Command] = []
    for doc in docs:
        text = doc.read_text()
        rel = doc.relative_to(ROOT) if doc.is_relative_to(ROOT) else doc
        first_found = len(found)
        for block in FENCE.finditer(text):
            start = _line_of(text, block.start())
            lines = block.group(0).splitlines()[1:-1]
            joined, first = "", None
            for i, line in enumerate(lines):
                if line.lstrip().startswith("#") and not joined:
                    continue
                first = first or start + 1 + i
                joined += line.rstrip("\\").strip() + " "
                if not line.rstrip().endswith("\\"):
                    found += _candidates(joined.strip(), str(rel), first)
                    joined, first = "", None
        prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        lines = prose.splitlines()
        i = 0
        while i < len(lines):  # indented code blocks (4 spaces), continuation lines joined
            if lines[i].startswith("    ") and lines[i].strip():
                start, joined = i + 1, lines[i].strip()
                while joined.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    joined = joined[:-1].rstrip() + " " + lines[i].strip()
                found += _candidates(joined, str(rel), start)
            i += 1
        for para_match in re.finditer(r"(?:[^\n]+\n?)+", prose):
            para = para_match.group(0)
            for span in SPAN.finditer(para.replace("\n", " ")):
                found += _candidates(span.group(1), str(rel), _line_of(prose, para_match.start() + span.start()))
        marks = {_line_of(text, m.start()): m.group(1) for m in SKIP_MARK.finditer(text)}
        for k in range(first_found, len(found)):
            line = int(found[k].where.rsplit(":", 1)[1])
            reason = next((r for at, r in marks.items() if 0 < line - at <= 3), None)
            if reason:
                found[k] = Command(found[k].where, found[k].text, reason)
    return tuple(found)


def _script_paths(word: str) -> list[Path]:
    """``scripts/serve_{vllm,sglang}_{a,b}_ep.sh`` and ``scripts/serve_sglang_*.sh`` -> the files they name."""
    parts = re.split(r"(\{[^}]*\})", word)
    options = [p[1:-1].split(",") if p.startswith("{") else [p] for p in parts]
    paths = []
    for combo in itertools.product(*options):
        paths += sorted(ROOT.glob("".join(combo))) if "*" in "".join(combo) else [ROOT / "".join(combo)]
    return paths


def test_the_finder_sees_the_docs_commands():
    """A finder that sees nothing would pass everything below: it must see the commands we know are there."""
    texts = [c.text for c in doc_commands()]
    assert any(t.startswith("MODEL=/models/DeepSeek-V4-Pro PRESET=reference scripts/serve_vllm_dsv4_pro_ep.sh") for t in texts)
    assert any(t.startswith("megamoe info") for t in texts)
    assert any("python3 -m benchmarks.bench_layer" in t for t in texts)
    assert any(t.startswith("EPLB=r64 scripts/serve_sglang_r1_mxfp4_ep.sh --dry-run") for t in texts)


def _check_knobs(cmd: Command, env: dict[str, str]) -> None:
    """The MEGA_* / AITER_* values a command sets are ones the knobs accept (read as the layer reads them)."""
    from megamoe_backend.knobs import KnobError, Knobs

    knobs = {k: v for k, v in env.items() if k.startswith(("MEGA_", "AITER_"))}
    try:
        Knobs.from_env(knobs)
    except KnobError as exc:
        pytest.fail(f"{cmd.where}: `{cmd.text}` sets a knob the layer refuses: {exc}")


def _skip_marked(cmd: Command) -> None:
    if cmd.skip:
        pytest.skip(f"{cmd.where}: the doc marks it as not runnable today: {cmd.skip}")


def test_planted_mistakes_are_found_and_fail(tmp_path):
    """The checks below fail on what they exist to catch: a script that does not exist, a variable the
    script does not read, a bad value, a flag the CLI does not have, a refused knob."""
    doc = tmp_path / "planted.md"
    doc.write_text("Run `scripts/serve_nope_ep.sh` or\n\n```bash\nWIRE=fp16 scripts/serve_vllm_dsv4_pro_ep.sh\n"
                   "FOO=1 scripts/serve_vllm_dsv4_pro_ep.sh\nmegamoe info --ep-sise 8\n"
                   "MEGA_EXPERTS_GEMM=cuda megamoe info\n```\n")
    found = {c.text.split()[0]: c for c in doc_commands((doc,))}
    missing, bad_value, unknown = found["scripts/serve_nope_ep.sh"], found["WIRE=fp16"], found["FOO=1"]
    bad_flag, bad_knob = found["megamoe"], found["MEGA_EXPERTS_GEMM=cuda"]
    with pytest.raises(AssertionError, match="does not exist"):
        test_named_scripts_exist_and_answer_help(_script_paths(missing.split()[1][0])[0])
    with pytest.raises(AssertionError, match="WIRE=fp16 is not valid"):
        test_script_invocations_dry_run_with_known_variables(bad_value)
    with pytest.raises(AssertionError, match=r"sets \['FOO'\]"):
        test_script_invocations_dry_run_with_known_variables(unknown)
    with pytest.raises(AssertionError, match="does not parse"):
        test_megamoe_commands_parse(bad_flag)
    with pytest.raises(pytest.fail.Exception, match="MEGA_EXPERTS_GEMM=cuda"):
        test_megamoe_commands_parse(bad_knob)


def _clean_env(**extra: str) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("MEGA_", "EPLB", "AITER_"))
            and k not in ("N", "DP", "WIRE", "MODEL", "PRESET", "BACKEND", "TRANSPORT", "MTPR", "DATASET")}
    bin_dir = str(Path(sys.executable).parent)
    return {**keep, "PATH": f"{bin_dir}{os.pathsep}{keep.get('PATH', '')}", "PYTHON": sys.executable, "CHECK": "0",
            **extra}


@lru_cache(maxsize=None)
def script_help(path: Path) -> subprocess.CompletedProcess:
    runner = ["bash"] if path.suffix == ".sh" else [sys.executable]
    return subprocess.run([*runner, str(path), "--help"], cwd=ROOT, env=_clean_env(), capture_output=True, text=True,
                          timeout=120)


def script_commands() -> list[Command]:
    return [c for c in doc_commands() if c.split()[1][0].startswith("scripts/")]


@pytest.mark.parametrize("path", sorted({p for c in script_commands() for p in _script_paths(c.split()[1][0])}),
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_named_scripts_exist_and_answer_help(path):
    assert path.is_file(), f"the docs name {path.relative_to(ROOT)}, which does not exist"
    if path.name.startswith("_"):
        return  # sourced by the scripts, not run
    proc = script_help(path)
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr


@pytest.mark.parametrize("cmd", [c for c in script_commands()
                                 if c.split()[1][0].endswith(".sh") and "{" not in c.split()[1][0]
                                 and "*" not in c.split()[1][0] and not c.split()[1][0].endswith("/test.sh")
                                 and not SYNOPSIS.search(c.text)], ids=lambda c: c.where)
def test_script_invocations_dry_run_with_known_variables(cmd):
    _skip_marked(cmd)
    env, words = cmd.split()
    _check_knobs(cmd, env)
    path = ROOT / words[0]
    listed = script_help(path).stdout
    unknown = [name for name in env if not re.search(rf"(?m)^\s+{name}\b|\b{name}[=:, ]", listed)]
    assert not unknown, f"{cmd.where}: `{cmd.text}` sets {unknown}, which {words[0]} --help does not list"
    args = words[1:] if "--dry-run" in words else ["--dry-run", *words[1:]]
    proc = subprocess.run(["bash", str(path), *args], cwd=ROOT, env=_clean_env(**env), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, f"{cmd.where}: `{cmd.text}` --dry-run: {proc.stderr}"


def megamoe_commands() -> list[Command]:
    out = []
    for c in doc_commands():
        _, words = c.split()
        if len(words) > 1 and (words[0] == "megamoe" or words[0].endswith("bin/megamoe")):  # not the bare name
            out.append(c)
    return out


@pytest.mark.parametrize("cmd", megamoe_commands(), ids=lambda c: c.where)
def test_megamoe_commands_parse(cmd):
    from megamoe_backend.cli.main import build_parser

    _skip_marked(cmd)
    env, words = cmd.split()
    _check_knobs(cmd, env)
    argv = words[1:]
    if SYNOPSIS.search(cmd.text):
        argv = [w for w in argv[:2] if not w.startswith(("-", "["))] + ["--help"]
    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:
        assert exc.code == 0 and "--help" in argv, f"{cmd.where}: `{cmd.text}` does not parse (exit {exc.code})"


def module_commands() -> list[Command]:
    out = []
    for c in doc_commands():
        _, words = c.split()
        if len(words) > 2 and words[1] == "-m" and words[2].startswith(MODULE_ROOTS):
            out.append(c)
    return out


@pytest.mark.parametrize("cmd", module_commands(), ids=lambda c: c.where)
def test_module_commands_parse_with_their_own_arguments(cmd):
    _skip_marked(cmd)
    env, words = cmd.split()
    _check_knobs(cmd, env)
    module = importlib.import_module(words[2])
    if SYNOPSIS.search(cmd.text) or not hasattr(module, "add_arguments"):
        return  # the module's --help is run below
    parser = argparse.ArgumentParser(prog=words[2])
    module.add_arguments(parser)
    try:
        parser.parse_args(words[3:])
    except SystemExit as exc:
        pytest.fail(f"{cmd.where}: `{cmd.text}` does not parse with {words[2]}'s arguments (exit {exc.code})")


@pytest.mark.parametrize("module", sorted({c.split()[1][2] for c in module_commands()}))
def test_named_modules_answer_help(module):
    proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, env=_clean_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stderr
