"""The README and docs/ stay what a user needs: short, linked, complete about the CLI, and free of
work diaries. Fast: reads markdown files and the typer app's own parameters, starts nothing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer.main

from mesh_llm.cli import app

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 420

# [text](target) and ![alt](target), not inside code: the target up to whitespace or ")"
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~)")


def prose(path: Path) -> str:
    """The file without fenced code blocks and inline code spans, where brackets are not links."""
    lines, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(lines)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lowercase, punctuation but hyphens and
    underscores removed, spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading: its text
    text = re.sub(r"[*_]{1,2}([^*_]+)[*_]{1,2}", r"\1", text)  # emphasis
    text = text.lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in a markdown file, with GitHub's -1, -2 for repeats."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fenced or not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def relative_links(path: Path) -> list[str]:
    return [t for t in LINK.findall(prose(path)) if not re.match(r"^[a-z][a-z0-9+.-]*:", t, re.I)]


def test_the_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; depth belongs in docs/"


def test_the_docs_folder_has_the_topics_the_readme_names():
    names = {p.name for p in DOCS}
    for topic in ("engines.md", "api.md", "batching-and-cache.md", "mesh.md", "architecture.md"):
        assert topic in names


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(doc: Path):
    broken = []
    for target in relative_links(doc):
        file_part, _, anchor = target.partition("#")
        linked = (doc.parent / file_part).resolve() if file_part else doc
        if not linked.exists():
            broken.append(f"{target}: no such file")
            continue
        if ROOT not in linked.parents and linked != ROOT:
            broken.append(f"{target}: outside the repository")
            continue
        if anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with that anchor in {linked.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_slug_follows_github():
    assert slug("The llama.cpp engine") == "the-llamacpp-engine"
    assert slug("`--deterministic`") == "--deterministic"
    assert slug("CUDA builds that carry their own libstdc++") == "cuda-builds-that-carry-their-own-libstdc"
    assert slug("`mesh-llm models`, `mesh-llm mesh`") == "mesh-llm-models-mesh-llm-mesh"


def cli_options() -> dict[str, list[str]]:
    """Every option string of `mesh-llm serve`, `bench` and each `models` and `mesh` subcommand,
    from the typer app itself (its click commands' parameters), by command path. Typer may carry
    its own copy of click, so groups and options are known by their attributes, not by class."""
    root = typer.main.get_command(app)
    found: dict[str, list[str]] = {}

    def walk(command, path: str) -> None:
        if hasattr(command, "commands"):  # a group
            for name, sub in command.commands.items():
                walk(sub, f"{path} {name}".strip())
            return
        found[path] = [opt for param in command.params if param.param_type_name == "option"
                       for opt in (*param.opts, *param.secondary_opts)]

    walk(root, "")
    return found


def test_the_cli_has_the_commands_the_readme_documents():
    commands = set(cli_options())
    assert {"serve", "bench", "models list", "models download", "models import-gguf",
            "mesh status"} <= commands


@pytest.mark.parametrize("command", sorted(cli_options()))
def test_every_cli_option_is_in_the_readme(command: str):
    text = README.read_text(encoding="utf-8")
    missing = [opt for opt in cli_options()[command]
               if not re.search(rf"(?<![\w-]){re.escape(opt)}(?![\w-])", text)]
    assert not missing, f"`mesh-llm {command}` options missing from README.md: {', '.join(missing)}"


# "the eleventh session", "session 12", "12th session", "a sitting", "sittings": work diaries
ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
            "thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|"
            "thirtieth|fortieth|last|previous|next|this|that|same|earlier|later|one|two|three|"
            "four|five|six|seven|eight|nine|ten")
NUMBERED_SITTING = re.compile(
    rf"\b(?:(?:twenty|thirty|forty)-?)?(?:{ORDINALS})\s+(?:device\s+)?session\b"
    r"|\b\d+(?:st|nd|rd|th)?\s+session\b|\bsession\s+\d+\b|\bsessions?\s+(?:#|no\.)\s*\d+"
    r"|\bsittings?\b",
    re.IGNORECASE)


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_no_numbered_sittings(doc: Path):
    hits = [f"line {n}: {line.strip()}" for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1)
            if NUMBERED_SITTING.search(line)]
    assert not hits, f"{doc.relative_to(ROOT)} speaks of work sittings: " + "; ".join(hits)


def test_the_sitting_pattern_catches_what_it_should():
    for diary in ("in the eleventh session", "the twenty-eighth session found", "session 12", "the 7th session",
                  "a sitting", "one device session"):
        assert NUMBERED_SITTING.search(diary), diary
    for fine in ("a TLS session", "an HTTP session resumes", "requests.Session()", "a new session id"):
        assert not NUMBERED_SITTING.search(fine), fine
