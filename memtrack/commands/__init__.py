"""The subcommands, one module each (memtrack.cli wires them to the command line): each
takes plain values, writes its output, and raises CommandError for a one-line error."""


class CommandError(Exception):
    """A command that cannot do what it was asked; the message is one line for the user
    (`memtrack: MESSAGE`)."""
