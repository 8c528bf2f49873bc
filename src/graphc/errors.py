"""The one exception type graphc raises for bad input.

The CLI turns a `GraphcError` into a one-line message and exit status 2; anything else is a bug
and keeps its traceback.
"""


class GraphcError(Exception):
    """Bad input from the user: a config value, a checkpoint, an artifact. The message names the
    offending field or value and says what is allowed."""


class ConfigError(GraphcError):
    """A `model.yaml` problem; the message starts with the key path."""


class Interrupted(BaseException):
    """The user stopped a command (SIGINT) or the system did (SIGTERM): not a bug, no traceback;
    the CLI exits 128 + the signal's number. A BaseException, as KeyboardInterrupt is: libraries
    that wrap every Exception they meet (torch.export.load does) must let it through."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signum}")
        self.signum = signum


class CheckpointError(GraphcError):
    """A checkpoint problem: missing dir, unsupported architecture, missing or mis-shaped tensor."""
