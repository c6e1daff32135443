"""``UserError``: what the command line reports to its user in one line, never as a traceback."""


class UserError(Exception):
    """An error worth one line to the user, never a traceback."""
