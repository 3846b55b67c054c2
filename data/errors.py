"""The one exception type of the data package."""


class DataError(ValueError):
    """The corpus or the prepared data is unusable; the message says which file and what to fix."""
