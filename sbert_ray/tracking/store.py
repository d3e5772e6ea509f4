"""The tracking store as sbert-ray talks to it: shown without credentials, checked before a run, called with short
timeouts and errors that never hold a password.

A tracking URI may carry a password (``https://user:PASS@host``, ``postgresql://user:PASS@host/db``). sbert-ray shows
and stores only ``redact_uri(uri)`` (params, config artifacts, model cards, printed output), and every MLflow error
passes through ``redact`` before it is raised or logged: MLflow's own messages quote the URI in full. For an MLflow
server, MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD in the environment keep the password out of config
files and shell history as well; that is the recommended way.

MLflow's HTTP client retries a request 7 times with a growing back-off, 120 s each: about 4 minutes before an
unreachable server is reported. ``mlflow_call`` makes one short attempt at a time (MLflow retries off, a timeout
per request) and does its own waiting, so a caller decides how long an outage may last.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import unquote, urlsplit

import requests
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from sbert_ray.tracking.errors import TrackingError, TrackingUnavailable

logger = logging.getLogger(__name__)

MASK = "***"
SECRET_QUERY_KEYS = {"password", "passwd", "pwd", "token", "access_token", "secret", "client_secret", "api_key"}
CREDENTIALS_HINT = (
    "put the user name and password of an MLflow server in MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD "
    "rather than in the URI"
)
# Default ports of the stores reached over the network: the reachability check connects to host:port first.
NETWORK_PORTS = {"http": 80, "https": 443, "postgresql": 5432, "mysql": 3306, "mssql": 1433}
CHECK_TIMEOUT_S = 5.0  # each of the two steps of the reachability check (TCP connect, one API call)

T = TypeVar("T")


def redact_uri(uri: str) -> str:
    """``uri`` with its password and secret query values replaced by ``***``:
    ``postgresql://user:***@host/db``, ``https://host/?token=***``; any other URI as it is."""
    userinfo = _unencoded_userinfo(uri)
    if userinfo is not None:
        scheme, _, rest = uri.partition("://")
        return redact_uri(f"{scheme}://{userinfo.partition(':')[0]}:{MASK}@{rest.partition('@')[2]}")
    if not _secrets(uri):
        return uri
    parts = urlsplit(uri)
    if parts.password is not None:
        userinfo, _, host = parts.netloc.rpartition("@")
        uri = uri.replace(parts.netloc, f"{userinfo.partition(':')[0]}:{MASK}@{host}", 1)
    if parts.query:
        query = "&".join(_mask_query_item(item) for item in parts.query.split("&"))
        uri = uri.replace(f"?{parts.query}", f"?{query}", 1)
    return uri


@dataclass(frozen=True)
class TrackingStore:
    """A tracking URI that cannot show its secrets: ``str()``, f-strings, ``repr`` and log lines give
    ``redact_uri(uri)``; only MLflow calls take ``.uri`` itself."""

    uri: str = field(repr=False)

    def __str__(self) -> str:
        return redact_uri(self.uri)

    def __repr__(self) -> str:
        return f"TrackingStore({str(self)!r})"

    def check(self) -> None:
        """Before any work: a password in the URI warned about, a server that does not answer refused
        (``check_reachable``)."""
        warn_if_password(self.uri)
        check_reachable(self.uri)


def open_store(uri: str) -> TrackingStore:
    """The store at ``uri``, checked before any work (``TrackingStore.check``)."""
    store = TrackingStore(uri)
    store.check()
    return store


def redact(text: str, uri: str) -> str:
    """``text`` (an error message, a log line) with every secret of ``uri`` masked, as written and URL-decoded."""
    for secret in _secrets(uri):
        text = text.replace(secret, MASK)
    return text


def warn_if_password(uri: str) -> None:
    """Say once per process that ``uri`` holds a password: masked in everything sbert-ray writes, it still sits in
    the config file or the shell history."""
    if _secrets(uri):
        _warn_password(redact_uri(uri))


@functools.cache
def _warn_password(shown: str) -> None:
    logger.warning(
        "the tracking URI %s holds a password: sbert-ray masks it in everything it logs and writes, but it stays in "
        "your config file or shell history; %s",
        shown,
        CREDENTIALS_HINT,
    )


def _unencoded_userinfo(uri: str) -> str | None:
    """The ``user:password`` of a URI whose password holds a ``/``, ``?`` or ``#`` that is not percent-encoded, else
    None. Such a character ends the host part early (``https://user:pa/ss@host``: host ``user``, port ``pa``, no
    password at all), so the password is read here as everything up to the ``@`` after it."""
    scheme, sep, rest = uri.partition("://")
    netloc = urlsplit(uri).netloc
    if not sep or "@" in netloc or "@" not in rest[len(netloc) :] or ":" not in netloc:
        return None
    return rest.partition("@")[0]


def _secrets(uri: str) -> list[str]:
    parts = urlsplit(uri)
    raw = [parts.netloc.rpartition("@")[0].partition(":")[2]] if parts.password is not None else []
    raw += [userinfo.partition(":")[2]] if (userinfo := _unencoded_userinfo(uri)) is not None else []
    raw += [value for key, _, value in (item.partition("=") for item in parts.query.split("&")) if _secret(key)]
    found = {form for secret in raw if secret for form in (secret, unquote(secret))}
    return sorted(found, key=len, reverse=True)  # longest first: a secret containing another is masked whole


def _secret(key: str) -> bool:
    return unquote(key).lower() in SECRET_QUERY_KEYS


def _mask_query_item(item: str) -> str:
    key, sep, _ = item.partition("=")
    return f"{key}={MASK}" if sep and _secret(key) else item


@contextlib.contextmanager
def mlflow_settings(uri: str, timeout_s: float) -> Iterator[None]:
    """MLflow inside this block: HTTP requests without retries of MLflow's own, at most ``timeout_s`` to connect
    and between bytes; no "View run at <uri>" lines when ``uri`` holds secrets. Values the user set in the
    environment win. (MLflow reads these variables on every request and run end.)"""
    settings = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": str(max(1, round(timeout_s)))}
    if _secrets(uri):
        settings["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
    ours = {key: value for key, value in settings.items() if key not in os.environ}
    os.environ.update(ours)
    try:
        yield
    finally:
        for key in ours:
            os.environ.pop(key, None)


def unavailable(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) says the store did not answer, rather than refused the call."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, requests.ConnectionError | requests.Timeout | requests.exceptions.RetryError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def mlflow_call(uri: str, call: Callable[..., T], *args: Any, timeout_s: float, wait_s: float = 0.0, **kwargs) -> T:
    """``call(*args, **kwargs)`` against the store at ``uri`` with short requests; while the store does not answer,
    try again (1, 2, 4 ... 30 s apart) for up to ``wait_s``. Errors come out as ``TrackingError`` (or
    ``TrackingUnavailable``) with the credentials of ``uri`` masked."""
    deadline = time.monotonic() + wait_s
    delay = 1.0
    while True:
        try:
            with mlflow_settings(uri, timeout_s):
                return call(*args, **kwargs)
        except (MlflowException, requests.RequestException, OSError) as err:
            message = redact(str(err), uri)
            if not unavailable(err):
                raise TrackingError(message) from None
            if time.monotonic() + delay > deadline:
                raise TrackingUnavailable(f"MLflow at {redact_uri(uri)} does not answer: {message}") from None
            logger.warning("MLflow at %s does not answer; trying again in %.0f s", redact_uri(uri), delay)
            time.sleep(delay)
            delay = min(2 * delay, 30.0)


def _port(uri: str) -> int | None:
    """The URI's port; a URI that cannot be read is a ``TrackingError`` that shows it masked (urllib's own
    ValueError quotes what it took for the port: the start of a password holding an unencoded ``/``)."""
    if _unencoded_userinfo(uri) is not None:
        raise TrackingError(
            f"the tracking URI {redact_uri(uri)} cannot be read: its password holds a '/', '?' or '#' that is not "
            f"percent-encoded (urllib.parse.quote(password, safe='') encodes it); or {CREDENTIALS_HINT}"
        )
    try:
        return urlsplit(uri).port
    except ValueError:
        raise TrackingError(f"the tracking URI {redact_uri(uri)} has a port that is not a number") from None


def check_reachable(uri: str, timeout_s: float = CHECK_TIMEOUT_S) -> None:
    """Raise ``TrackingUnavailable`` (within about 2 x ``timeout_s``) when the store at ``uri`` is a server that does
    not answer: a TCP connection to its host and port, then, for an MLflow server, one API call (which also checks
    the credentials). Local stores (sqlite, file) have nothing to reach."""
    parts = urlsplit(uri)
    scheme = parts.scheme.partition("+")[0]  # postgresql+psycopg2 -> postgresql
    if scheme not in NETWORK_PORTS:
        return
    shown = redact_uri(uri)
    address = (parts.hostname or "localhost", _port(uri) or NETWORK_PORTS[scheme])
    try:
        socket.create_connection(address, timeout=timeout_s).close()
    except OSError as err:
        reason = "timed out" if isinstance(err, TimeoutError) else (err.strerror or str(err))
        raise TrackingUnavailable(
            f"the tracking store {shown} cannot be reached ({address[0]}:{address[1]}: {reason}); start it, or "
            "point tracking.tracking_uri (or MLFLOW_TRACKING_URI) at one that runs"
        ) from None
    if scheme not in ("http", "https"):
        return  # a database: the connection is MLflow's (SQLAlchemy's) to make
    try:
        with mlflow_settings(uri, timeout_s):
            MlflowClient(uri).search_experiments(max_results=1)
    except (MlflowException, requests.RequestException, OSError) as err:
        message = redact(str(err), uri)
        if unavailable(err):
            raise TrackingUnavailable(f"the MLflow server {shown} does not answer: {message}") from None
        status = err.get_http_status_code() if isinstance(err, MlflowException) else None
        hint = f"; check the user name and password ({CREDENTIALS_HINT})" if status in (401, 403) else ""
        raise TrackingError(f"the MLflow server {shown} refused a request: {message}{hint}") from None
