"""The one exception type users see.

Everything a user can get wrong (a checkpoint, a config, a prompt, a tree, a heads file) raises
`CloverError` with a one-line message that names the problem and what to do; the command-line tools
print that line and exit with status 2 instead of a traceback.

A message speaks of the arguments a Python caller passed, in keyword spelling (`max_len=`, or
`draft_vocab=7` with the value given), and of files; never of a tool's flags. The error lists the
arguments its message names (`arguments`), so that a tool, whose user typed flags, prints each as its
flag (`clover_jax._cli.run.flag_message`: `max_len=` reads `--max-len` there).
"""

from __future__ import annotations

from typing import Iterable


class CloverError(ValueError):
    """A user-facing error: the message is one line, naming the problem and the fix. `arguments`: the
    names of the arguments it names as `name=` (the module docstring)."""

    def __init__(self, message: str = "", *, arguments: Iterable[str] = ()):
        super().__init__(message)
        self.arguments = tuple(arguments)
