"""A handler whose args hold a secret it declares redact=[...]: it logs and fails with it."""

import logging

from pgjobd import JobContext, job

log = logging.getLogger(__name__)


@job(max_attempts=1, redact=["password", "card.number"])
def leaks_its_secrets(args: dict[str, object], ctx: JobContext) -> None:
    card = args["card"]
    assert isinstance(card, dict)
    ctx.logger.info("logging in with %s and card %s", args["password"], card["number"])
    log.warning("module logger saw %s", args["password"])
    raise RuntimeError(f"login failed for password {args['password']} card {card['number']}")
