"""Errors raised by te-compile. All are RuntimeErrors, as TE's own are."""


class TECompileError(RuntimeError):
    """Base class for te-compile errors."""


class UnsupportedVersionError(TECompileError):
    """The installed torch or Transformer Engine is outside the supported range."""


class UnsupportedUnderCompileError(TECompileError):
    """A TE option that eager TE supports but the compiled path does not (yet).

    The message names the option and the way out. Under ``fullgraph=True`` dynamo reports a user
    exception as an "Observed exception" graph break that carries this message.
    """


class RecipeNotSupportedError(TECompileError):
    """The GPU cannot run the requested recipe (TE's own reason is the message)."""
