"""One exception type for every user-facing mistake, so the CLI can print it as one clear line.

Each message names the problem and the fix. `bertaccel.cli.main` catches `BertAccelError` and prints
`bertaccel: error: <message>` without a traceback; library users get a normal exception.
"""


class BertAccelError(ValueError):
    """A configuration, data or checkpoint problem the user can fix."""


class DataError(BertAccelError):
    """The data cannot be found or read, or a row is malformed."""


class ConfigError(BertAccelError):
    """Options that contradict each other or the model."""


class CheckpointError(BertAccelError):
    """A checkpoint that is missing, corrupt, or does not match the config."""
