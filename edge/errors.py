"""The runtime's error base. Every error edgespec raises on purpose is an EngineError (ModelDirError too), so an
app embedding the API can catch one class around load and generation; the message says what to change."""


class EngineError(Exception):
    """Bad request or unusable state; the message says what to change."""
