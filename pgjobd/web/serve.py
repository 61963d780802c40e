"""`pgjobd web`: the console served by uvicorn, on [web] listen (or --listen)."""

from __future__ import annotations

import logging
import socket

import uvicorn

from pgjobd.config import Config
from pgjobd.web.app import create_app
from pgjobd.web.auth import read_token

log = logging.getLogger(__name__)


def run(config: Config, host: str, port: int) -> None:
    """Serve until SIGINT or SIGTERM (uvicorn's handlers: finish requests, then exit)."""
    token_file = config.web.admin_token_file
    token = read_token(token_file) if token_file is not None else None
    app = create_app(
        schema=config.database.schema, token=token, dsn=config.require_dsn(),
        statement_timeout_s=config.database.statement_timeout.total_seconds(),
        refresh_s=config.web.refresh.total_seconds(),
    )  # fmt: skip
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        message = f"web.listen: cannot listen on {host}:{port}: {e.strerror}"
        raise OSError(e.errno, message) from None
    port = sock.getsockname()[1]  # the port the system chose for 0
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")
    )
    log.info(
        "console on http://%s:%d/ (%s)", host, port,
        "read-only" if token is None else "actions with the admin token",
        extra={"event": "web.listening", "host": host, "port": port, "read_only": token is None},
    )  # fmt: skip
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
