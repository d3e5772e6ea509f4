"""Tracking errors, importable without MLflow: the command line catches them on every command."""


class TrackingError(RuntimeError):
    """An MLflow call failed; the message names the store by its masked URI and holds no credentials."""


class TrackingUnavailable(TrackingError):
    """The tracking store did not answer: connection refused, a timeout, or a server error (5xx)."""
