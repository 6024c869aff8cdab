"""The one error type of the pipeline's pre-flight checks."""


class ConfigError(ValueError):
    """A configuration, data set or tracking server that cannot work; the message says what to fix.

    Raised before training starts; the CLI prints the message alone (no traceback) and exits 2.
    """
