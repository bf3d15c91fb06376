"""Docs stay true to the tree: every relative link in the README and docs/ and every
docs/ file named in the code, the benches and the tests exists."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")
DOC_MENTION = re.compile(r"\bdocs/[A-Za-z0-9_./-]+\.md\b")


def _markdown() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_relative_link_resolves():
    broken = []
    for doc in _markdown():
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL, or an anchor in the same page
            path = target.split("#", 1)[0]
            if not (doc.parent / path).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def _sources() -> list[Path]:
    """The project's own code, scripts and build files (this file's examples aside)."""
    out = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("build", "__pycache__")
                   and not d.endswith(".egg-info")]
        out += [Path(folder) / f for f in files if f.endswith((".py", ".sh", ".toml")) or f == "Makefile"]
    return [p for p in out if p != Path(__file__).resolve()]


def test_every_docs_file_named_in_the_code_exists():
    missing = set()
    for src in _sources():
        rel = src.relative_to(ROOT)
        for name in DOC_MENTION.findall(src.read_text(errors="replace")):
            if not (ROOT / name).exists():
                missing.add(f"{rel}: {name}")
    assert not missing, sorted(missing)


def test_the_checks_see_a_broken_link(tmp_path):
    assert LINK.findall("see [the schema](docs/nothing.md#x) and [web](https://x.y)") == ["docs/nothing.md#x",
                                                                                         "https://x.y"]
    assert DOC_MENTION.findall("read docs/capture.md, then docs/gone.md.") == ["docs/capture.md", "docs/gone.md"]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def test_every_anchor_names_a_heading():
    broken = []
    for doc in _markdown():
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target) or "#" not in target:
                continue
            path, anchor = target.split("#", 1)
            page = (doc.parent / path) if path else doc
            slugs = {_slug(h) for h in re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)}
            if anchor not in slugs:
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, broken


# `moetrace COMMAND`, not a log line's `moetrace guard: ...`
COMMAND = re.compile(r"(\$\(|^|[\s\"'])moetrace\s+([a-z][a-z-]*)(?=\s|$|\))(.*)")


def _code(text: str) -> list[str]:
    """Lines of the fenced code blocks (continuations joined) and the inline code spans."""
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.M | re.S)
    lines = [line for b in blocks for line in b.replace("\\\n", " ").splitlines()]
    without_blocks = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return lines + re.findall(r"`([^`\n]+)`", without_blocks)


def _invocations(line: str) -> list[tuple[str, list[str]]]:
    """(command, its --options) of every `moetrace COMMAND ...` in one line of code: the
    options up to a `--` (the server's command follows) or a comment; inside `$(...)` or
    quotes up to their end."""
    import shlex

    out = []
    for m in COMMAND.finditer(line):
        opened = {"$(": ")", '"': '"', "'": "'"}.get(m.group(1))  # a command inside $( ) or quotes ends there
        rest = m.group(3).split(opened, 1)[0] if opened else m.group(3)
        try:
            tokens = shlex.split(rest, comments=True)
        except ValueError:  # an unbalanced quote: a fragment in prose
            tokens = rest.split()
        options = []
        for t in tokens:
            if t == "--":
                break
            if t.startswith("--"):
                options.append(t.split("=")[0])
        out.append((m.group(2), options))
        out += _invocations(m.group(3))
    return out


def test_every_documented_command_and_option_exists():
    """The README's recipes and the docs' examples name real commands and options."""
    from moetrace.cli import main

    wrong = []
    for doc in _markdown():
        for line in _code(doc.read_text()):
            for name, options in _invocations(line):
                cmd = main.commands.get(name)
                if cmd is None:
                    wrong.append(f"{doc.name}: moetrace {name}")
                    continue
                known = {o for p in cmd.params for o in getattr(p, "opts", []) + getattr(p, "secondary_opts", [])}
                wrong += [f"{doc.name}: moetrace {name} {o}" for o in options if o not in known | {"--help"}]
    assert not wrong, wrong


def test_the_option_check_reads_what_it_must():
    line = 'moetrace audit --launch "python -m x --tp 2" --index i.parquet --junit=j.xml  # --not-this'
    assert _invocations(line) == [("audit", ["--launch", "--index", "--junit"])]
    nested = '--forward-hooks "$(moetrace hook-spec --out /t --guard alert)" --tp 2'
    assert _invocations(nested) == [("hook-spec", ["--out", "--guard"])]
    assert _invocations("moetrace guard: rank 1 step 0 layer 0") == []
    assert _invocations("moetrace launch --out t -- python -m sglang.launch_server --tp 2") == [("launch", ["--out"])]
    quoted = "moetrace audit --launch 'moetrace serve C --tp 2 --port 1' --prompt-tokens 9"
    assert _invocations(quoted) == [("audit", ["--launch", "--prompt-tokens"]), ("serve", ["--tp", "--port"])]


def test_no_doc_installs_moetrace_from_the_package_index():
    """moetrace is not on the package index: the docs install it from a checkout or a wheel."""
    from_index = re.compile(r"pip install\s+(-\S+\s+)*['\"]?moetrace(\[[a-z,]+\])?['\"]?(\s|$|`)")
    found = [f"{p.relative_to(ROOT)}: {line.strip()}" for p in _markdown()
             for line in p.read_text().splitlines() if from_index.search(line)]
    assert found == []
    assert from_index.search("pip install 'moetrace[guard]'") and from_index.search("pip install moetrace  # x")
    assert not from_index.search("pip install /path/to/moetrace") and not from_index.search("pip install moetrace-0.1.whl")


def test_the_documented_report_version_is_the_written_one():
    from moetrace.schema import REPORT_SCHEMA_VERSION

    text = (ROOT / "docs" / "analysis.md").read_text()
    documented = re.findall(r'`"moetrace\.analysis"`; `version`: `(\d+)`', text)
    assert documented == [str(REPORT_SCHEMA_VERSION)]
    assert f"(`--json`, schema `moetrace.analysis`, version {REPORT_SCHEMA_VERSION})" in text
