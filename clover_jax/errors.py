"""The one exception type users see.

Everything a user can get wrong (a checkpoint, a config, a prompt, a tree, a heads file) raises
`CloverError` with a one-line message that names the problem and what to do; the command-line tools
print that line and exit with status 2 instead of a traceback.
"""


class CloverError(ValueError):
    """A user-facing error: the message is one line, naming the problem and the fix."""
