"""MPI's remote shell for Trainyard: `python -m agent.rsh NODE COMMAND...` (SPEC L2).

OpenMPI's mpirun starts a daemon on every other node of a job through a remote shell (normally
ssh). The Horovod mode points it here (OMPI_MCA_plm_rsh_agent): the node agent of NODE runs the
command inside the same job's environment and process group, and this process lasts as long as
that command and exits with its code. No ssh keys or daemons are needed on the nodes.
"""

from __future__ import annotations

import asyncio
import os
import sys

from agent.processes.jobenv import JOB_TOKEN_VARIABLE
from libs.auth import bearer_headers
from libs.contracts import subjects
from libs.contracts.agent import ExecExited, ExecInJob, ProcessAccepted
from libs.contracts.codec import decode, decode_any, encode
from libs.contracts.operations.base import CommandError
from libs.messaging.connection import NatsLogin, connect


async def run(node: str, command: str) -> int:
    job_id, token = os.environ["TRAINYARD_JOB_ID"], os.environ.get(JOB_TOKEN_VARIABLE, "")
    # The job's own login (its token from the launcher): exec on its own nodes, answers in its own inbox.
    nc = await connect(os.environ["NATS_URL"], f"trainyard-rsh-{node}", NatsLogin.for_job(job_id, token))
    try:
        inbox = nc.new_inbox()
        exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def on_exit(msg: object) -> None:
            if not exited.done():
                exited.set_result(decode(msg.data, ExecExited).exit_code)  # type: ignore[attr-defined]

        await nc.subscribe(inbox, cb=on_exit)
        request = ExecInJob(job_id=job_id, attempt=int(os.environ["TRAINYARD_ATTEMPT"]),
                            task=int(os.environ.get("TRAINYARD_TASK", "0")), command=command, reply_to=inbox)
        # The token again with the request: the agent runs it only for the attempt that holds this token.
        answer = await nc.request(subjects.agent_exec(node), encode(request), timeout=10, headers=bearer_headers(token))
        reply = decode_any(answer.data, ProcessAccepted | CommandError)
        if isinstance(reply, CommandError):
            print(f"trainyard rsh: {node}: {reply.message}", file=sys.stderr)
            return 255
        return await exited
    finally:
        await nc.close()


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit("usage: python -m agent.rsh NODE COMMAND...")
    # Like ssh, the remote side gets one command line: the arguments joined by spaces.
    sys.exit(asyncio.run(run(sys.argv[1], " ".join(sys.argv[2:]))))


if __name__ == "__main__":
    main()
