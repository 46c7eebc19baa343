"""Every runtime role this box runs: one ``RoleRunner`` per role of its deployment.

A box with one GPU (or none) runs one role of a deployment; a box with several GPUs can run
one per GPU, each on the device its spec names. A box serves one deployment at a time: a
role of another deployment, when one starts, stops every role of the one before. Commands
for main (generations, cancels, alignment) go to the runner of main; a stop names one role,
or every role of a deployment.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from agent.credentials import NodeCredential
from agent.runtime import RoleRunner, Send, remove_stale_specs, role_name_of
from agent.spawn import RoleSpawner
from agent.tls import ServerTrust
from inference.wire.generation import Failed, Generate
from inference.wire.link import ApplyAlignment, CancelGeneration, StartRole


class Roles:
    def __init__(
        self,
        credential: NodeCredential,
        state_dir: Path,
        send: Send,
        trust: ServerTrust | None = None,
        spawner: RoleSpawner | None = None,
    ) -> None:
        self.credential = credential
        self.state_dir = state_dir
        self.send = send
        self.trust = trust  # the agent's trust in the server, shared by every runner's downloads
        self.spawner = spawner or RoleSpawner()  # how every runner starts its role process
        self.runners: dict[tuple[str, str], RoleRunner] = {}  # (deployment, role name) -> its runner
        remove_stale_specs(state_dir)  # no role runs before this agent starts one

    def use_credential(self, credential: NodeCredential) -> None:
        """The node credential was rotated: every later download uses the new one."""
        self.credential = credential
        for runner in self.runners.values():
            runner.credential = credential

    def snapshot(self) -> list[dict]:
        """Every role's state for the heartbeat (stopped and failed ones too, until replaced)."""
        return [state for runner in self.runners.values() if (state := runner.snapshot())]

    async def start(self, command: StartRole) -> None:
        """Start the role (a repeat of a running one is ignored); another deployment's roles stop first."""
        others = [key for key in self.runners if key[0] != command.deployment]
        for key in others:
            await self.runners.pop(key).stop()
        key = (command.deployment, role_name_of(command.spec))
        runner = self.runners.get(key)
        if runner is None:
            runner = self.runners[key] = RoleRunner(
                self.credential, self.state_dir, self.send, self.trust, self.spawner
            )
        await runner.start(command)

    async def stop(self, deployment: str, role_name: str = "") -> None:
        """Stop role ``role_name`` of ``deployment``, or every role of it for ""."""
        chosen = [r for (d, name), r in self.runners.items() if d == deployment and role_name in ("", name)]
        await asyncio.gather(*(runner.stop(deployment) for runner in chosen))

    async def close(self) -> None:
        """The agent is stopping: so does every role."""
        await asyncio.gather(*(runner.close() for runner in self.runners.values()))

    def main(self, deployment: str | None = None) -> RoleRunner | None:
        """The runner of main (of ``deployment`` when given), if this box runs it."""
        for (d, name), runner in self.runners.items():
            if name == "main" and deployment in (None, d):
                return runner
        return None

    async def apply_alignment(self, command: ApplyAlignment) -> None:
        runner = self.main(command.deployment)
        if runner is not None:
            await runner.main_work.apply_alignment(command)

    async def generate(self, command: Generate) -> None:
        runner = self.main(command.deployment)
        if runner is None:
            error = f"this box does not run a ready main for deployment {command.deployment}"
            await self.send(Failed(request_id=command.request_id, error=error))
            return
        await runner.main_work.generate(command)

    async def cancel(self, command: CancelGeneration) -> None:
        runner = self.main()
        if runner is not None:
            await runner.main_work.cancel(command)
