"""The one exception type that the CLI turns into a short message instead of a traceback."""


class VitftError(Exception):
    """A user-facing error: one line that says what is wrong and how to fix it."""
