#!/usr/bin/env python3
"""Checks README.md and docs/*.md against the tree: what a reader can follow must exist.

    python3 scripts/check_docs.py        # exit 1 and one line per problem, else "docs: ok"

- README.md has at most 300 lines (a product page; the rest lives in docs/);
- every relative link and image of README.md and docs/*.md names a file that exists, and
  every #anchor a heading of that file (GitHub's anchor rule);
- every command quoted in README.md (lines of ```sh blocks and `...` spans that start with a
  script, a bench or an example) names files that exist: scripts/*, examples/*, bench/*,
  clusters/*, models/*; a build/NAME binary is a bench (bench/NAME.cc), the library, a test
  binary, or built by the README itself (build/hello_attention); and each --flag given to a
  bench appears in that bench's source.
Standard library only.
"""

from __future__ import annotations

import glob
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_README_LINES = 300
# build/ names that are not benches: the library, the test binaries, what the README builds.
BUILT_ELSEWHERE = {"libhsap", "tests", "hello_attention", "jit"}


def anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    out, fence = set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence and line.startswith("#"):
            out.add(anchor(line.lstrip("#")))
    return out


def check_links(doc: Path, problems: list[str]) -> None:
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        file_part, _, frag = target.partition("#")
        path = (doc.parent / file_part).resolve() if file_part else doc
        if not path.exists():
            problems.append(f"{doc.relative_to(ROOT)}: link to missing {target}")
        elif frag and path.suffix == ".md" and frag not in anchors(path):
            problems.append(f"{doc.relative_to(ROOT)}: no heading for #{frag} in "
                            f"{path.relative_to(ROOT)}")


def readme_commands(text: str) -> list[str]:
    commands = []
    for block in re.findall(r"^```sh\n(.*?)^```", text, re.S | re.M):
        joined = re.sub(r"\\\n\s*", " ", block)
        commands += [line.split("#")[0].strip() for line in joined.splitlines()]
    commands += re.findall(r"`((?:bash |python3 |torchrun |build/|scripts/|cc )[^`]+)`", text)
    return [c for c in commands if c]


def check_command(command: str, problems: list[str]) -> None:
    for word in command.replace("&&", " ").split():
        word = word.split("=", 1)[-1] if word.startswith("--") else word
        if re.match(r"(scripts|examples|bench|clusters|models|include)/", word):
            if not glob.glob(str(ROOT / word)):
                problems.append(f"README.md: `{command}` names missing {word}")
    for binary, args in re.findall(r"build/(\w+)((?:\s+[^|;&]*)?)", command):
        source = ROOT / "bench" / f"{binary}.cc"
        if binary in BUILT_ELSEWHERE:
            continue
        if not source.exists():
            problems.append(f"README.md: `{command}`: no bench/{binary}.cc")
            continue
        # A bench's source: bench/NAME.cc and its parts, bench/<NAME without hsap_>_*.cc
        # (hsap_attn_perf: attn_perf_options.cc, ...).
        parts = glob.glob(str(ROOT / "bench" / f"{binary.removeprefix('hsap_')}_*.cc"))
        code = source.read_text() + "".join(Path(p).read_text() for p in sorted(parts))
        for flag in re.findall(r"(?<!\S)(--[\w-]+)", args):
            if f'"{flag}"' not in code and f'"{flag[2:]}"' not in code:
                problems.append(f"README.md: `{command}`: {binary} has no flag {flag}")


def main() -> int:
    problems: list[str] = []
    readme = ROOT / "README.md"
    lines = readme.read_text().count("\n")
    if lines > MAX_README_LINES:
        problems.append(f"README.md: {lines} lines, more than {MAX_README_LINES}")
    for doc in [readme, *sorted((ROOT / "docs").glob("*.md"))]:
        check_links(doc, problems)
    for command in readme_commands(readme.read_text()):
        check_command(command, problems)
    for p in problems:
        print(p)
    if not problems:
        print(f"docs: ok (README.md {lines} lines)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
