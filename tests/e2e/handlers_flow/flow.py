"""Handlers for the flow-control end-to-end tests: a ledger of who ran what, when. Kept
apart from ../handlers because a kind with a limit puts every queue of the fleet on the
limited claim path; ../handlers_flow_capped adds such a kind (its flow.py and _ledger.py
are links to these)."""

from pgjobd import JobContext, job

from ._ledger import Ledger, run


@job(queue="api")
def limited_record(args: Ledger, ctx: JobContext) -> None:
    run(args, ctx)
