"""The README and docs/ say only what exists: every relative link points at a file (and an
anchor at a heading), every `make` target and `dapple` subcommand named exists, and every flag
written after a `dapple <command>` is one that command defines."""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                              if f.endswith(".md"))


def read(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def anchors(markdown):
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for heading in re.findall(r"^#+ (.*)$", markdown, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


@pytest.mark.parametrize("doc", DOCS)
def test_relative_links_point_at_existing_files_and_headings(doc):
    text = read(doc)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(doc), path)) if path else doc
        assert os.path.exists(os.path.join(ROOT, resolved)), f"{doc}: {target}"
        if anchor and resolved.endswith(".md"):
            assert anchor in anchors(read(resolved)), f"{doc}: no heading for #{anchor}"


def test_readme_starts_with_the_two_commands():
    lines = [l for l in read("README.md").splitlines() if l.strip()]
    assert lines[1:4] == ["```", "make demo     # set up .venv, then profile, plan, report and "
                          "train a small model, pipelined",
                          "make test     # set up .venv, then run the test suite"]


def test_readme_is_short():
    assert len(read("README.md").encode()) < 15 * 1024


@pytest.mark.parametrize("doc", DOCS)
def test_make_targets_and_dapple_commands_named_exist(doc):
    from dapple.cli import COMMANDS
    makefile = read("Makefile")
    text = read(doc)
    for target in re.findall(r"(?:^|`|DAPPLE_GPU=1 )make ([a-z][a-z-]*)", text, re.M):
        assert re.search(rf"^{target}:", makefile, re.M), f"{doc}: make {target}"
    for line in text.splitlines():
        commands = {c for c in re.findall(r"\bdapple ([a-z]+)", line) if c in COMMANDS}
        if len(commands) != 1:
            continue          # prose ("dapple trains ..."), or several commands on one line
        command = commands.pop()
        defined = set(re.findall(r'DEFINE_\w+\(\s*"(\w+)"',
                                 read(os.path.join("dapple", "commands", f"{command}.py"))))
        for flag in re.findall(r"(?<![\w-])--(\w+)", line.split(" -- ")[0]):
            assert flag in defined, f"{doc}: dapple {command} has no --{flag}: {line}"


def test_the_readme_names_every_dapple_command():
    from dapple.cli import COMMANDS
    text = read("README.md")
    for command in COMMANDS:
        assert f"dapple {command}" in text, command


@pytest.mark.parametrize("doc", DOCS)
def test_files_named_in_backticks_exist(doc):
    for path in re.findall(r"`((?:[a-z_]+/)+[\w.-]+\.(?:py|sh|md|json|png|toml))`", read(doc)):
        assert os.path.exists(os.path.join(ROOT, path)), f"{doc}: {path}"

