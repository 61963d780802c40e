"""A kind that declares its own fleet-wide limit (which puts every queue of the fleet
on job_claim_flow)."""

from pgjobd import JobContext, job

from ._ledger import Ledger, run


@job(queue="api", global_concurrency=2, rate_limit="1000/1s")
def capped_record(args: Ledger, ctx: JobContext) -> None:
    run(args, ctx)
