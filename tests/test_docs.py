"""The docs a user reads stay true to the code: every module is in docs/architecture.md's file table, every
flag of a tool is on its page, every relative link leads to a file, and no code cites a document the
repository does not hold."""

import argparse
import re
from pathlib import Path

import pytest

from infer import benchmark, generate
from train import curves, evaluate, make_data, merge_data
from train import train as train_tool

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("clover_jax", "infer", "train", "device")


def module_files() -> list[str]:
    return sorted(p.relative_to(REPO).as_posix() for package in PACKAGES for p in (REPO / package).rglob("*.py")
                  if p.name != "__init__.py")


def test_every_module_has_a_line_in_the_architecture_file_table():
    text = (REPO / "docs" / "architecture.md").read_text()
    table = text[text.index("## The files"):text.index("## One speculative step")]
    listed = set(re.findall(r"^\| `([^`]+\.py)` \|", table, re.M))
    files = module_files()
    assert len(files) > 40  # the four packages were found
    assert not [f for f in files if f not in listed], "add these modules to docs/architecture.md's file table"
    assert not [f for f in listed if not (REPO / f).is_file()], "the file table names modules that are gone"


def flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"}


@pytest.mark.parametrize("page, parsers", [
    ("generate.md", [generate.build_parser]),
    ("benchmark.md", [benchmark.build_parser]),
    ("train.md", [make_data.build_parser, train_tool.build_parser, evaluate.build_parser, merge_data.build_parser,
                  curves.build_parser]),
])
def test_each_tool_page_names_every_flag_of_its_tools(page, parsers):
    text = (REPO / "docs" / page).read_text()
    named = set(re.findall(r"--[a-z][a-z0-9-]*", text))
    missing = sorted(f for build in parsers for f in flags(build()) if f not in named)
    assert not missing, f"docs/{page} does not describe {missing}"


def markdown_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "models").rglob("*.md"))]


def test_relative_links_lead_to_files():
    broken = []
    for page in markdown_files():
        prose = re.sub(r"```.*?```|`[^`\n]*`", "", page.read_text(), flags=re.S)  # code is not links
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            path = target.split("#")[0]
            if path and not re.match(r"[a-z]+:", path) and not (page.parent / path).exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert not broken, broken


def test_no_code_cites_a_document_users_do_not_have():
    sources = [p for folder in (*PACKAGES, "tests") for p in sorted((REPO / folder).rglob("*.py"))]
    citing = [f"{p.relative_to(REPO)}:{n}" for p in sources
              for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"SPEC (section|§)", line)]
    assert not citing, citing


def test_the_readmes_two_commands_are_the_quick_start_and_the_tests():
    readme = (REPO / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    assert "python -m infer.generate --model smollm2 --chat --method clover2" in blocks[0]
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert "python -m pytest" in blocks[1] and all(line in ci for line in blocks[1].strip().splitlines())
    assert len(readme.splitlines()) <= 220, "the README is the front page: usage goes to docs/"
