"""The data pipeline's error type."""


class DataError(ValueError):
    """Unreadable or unusable data. The message is one line naming the file (and line)."""
