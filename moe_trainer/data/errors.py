"""The one error type of the data package."""


class DataError(ValueError):
    """Bad data files or inputs: the message is one user-facing sentence."""
