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


def check_batch_sizes(batch_size: int, eval_batch_size: int | None) -> None:
    """Batch sizes are positive integers (`data.batch_size`, `data.eval_batch_size`)."""
    for name, value in (("batch_size", batch_size), ("eval_batch_size", eval_batch_size)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise DataError(f"data.{name} must be a positive integer, got {value!r}; e.g. --data.init_args.{name} 16.")
