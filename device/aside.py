"""`python -m device.aside out|back|status`: the heavy tracked folders moved out of the tree a device
call sends, for the length of a lease, and back.

The device tool sends the checkout's tracked and untracked-not-ignored files, 64 MiB a call with the
carried parts; models/reference (47 MB), models/smollm2/heads (64 MB) and models/gemma3/heads (60 MB)
alone are more, and a check needs none of them from the tree (the heads travel as a staged part). `out` renames them into .device-aside/
(ignored, so it does not travel), `back` renames them back. Each folder moves by one rename on the same
file system, so an interrupted run leaves every folder either in its place or in .device-aside, never
half moved, and `back` (or `out`) run again finishes the job. While they are aside, `git status` shows
their files deleted and the test suite cannot run: tell the team, commit nothing with `-a`, and run
`back` as soon as the lease's last call returns.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ASIDE = REPO / ".device-aside"
FOLDERS = ("models/reference", "models/smollm2/heads", "models/gemma3/heads")


def exclude(pattern: str, repo: Path = REPO) -> None:
    """Add `pattern` to the checkout's own ignore list (.git/info/exclude), once."""
    info = repo / ".git" / "info"
    info.mkdir(parents=True, exist_ok=True)
    path = info / "exclude"
    lines = path.read_text().splitlines() if path.is_file() else []
    if pattern not in lines:
        path.write_text("\n".join([*lines, pattern]) + "\n")


def where(folder: str, repo: Path = REPO, aside: Path = ASIDE) -> str:
    """'tree', 'aside', 'both' (a checkout restored them while aside) or 'missing'."""
    here, there = (repo / folder).exists(), (aside / folder).exists()
    return {(True, False): "tree", (False, True): "aside", (True, True): "both", (False, False): "missing"}[(here, there)]


def move(direction: str, repo: Path = REPO, aside: Path = ASIDE, folders=FOLDERS) -> list[str]:
    """Rename each folder out of the tree (`out`) or back (`back`); lines saying what happened."""
    exclude("/" + aside.name + "/", repo)
    lines = []
    for folder in folders:
        state = where(folder, repo, aside)
        if state == "both":
            raise SystemExit(f"error: {folder} is both in the tree and in {aside.name}/ (restored by git while "
                             f"aside?); compare them, then delete one copy by hand")
        src, dst = (repo / folder, aside / folder) if direction == "out" else (aside / folder, repo / folder)
        if state == ("tree" if direction == "out" else "aside"):
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.rename(src, dst)
            lines.append(f"{folder}: {'moved to ' + aside.name + '/' if direction == 'out' else 'back in the tree'}")
        else:
            lines.append(f"{folder}: already {state}")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv not in (["out"], ["back"], ["status"]):
        print(__doc__.split("\n\n")[0] + "\nusage: python -m device.aside out|back|status", file=sys.stderr)
        return 2
    if argv[0] == "status":
        for folder in FOLDERS:
            print(f"{folder}: {where(folder)}")
        return 0
    for line in move(argv[0]):
        print(line)
    if argv[0] == "out":
        from device.pack import tree_bytes

        print(f"the tree now sends {tree_bytes() / 2**20:.1f} MiB; run `python -m device.aside back` after the lease")
    return 0


if __name__ == "__main__":
    sys.exit(main())
