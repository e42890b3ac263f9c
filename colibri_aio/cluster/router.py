"""Ray Serve's request router for the engine replicas: a request goes where the gateway says.

The gateway chooses the replica of each generation request itself
(:class:`~colibri_aio.cluster.affinity.ReplicaChooser`, which knows the
conversation keys and counts what it sent where), and names it in the call's
``route_to`` keyword; this router sends the request there. A request that
names no replica, or one that has gone, goes to any replica with room: Ray
then takes the least loaded of them.

The router also keeps the :class:`ReplicaBoard` of its deployment up to date:
Ray tells every router which replicas run, and the gateway, in the same
process (a handle's router lives beside the handle), reads the board to know
them. (Ray ships a router class to each process by value, with its module's
globals: the boards live in another module, which it imports by name.)
"""
from __future__ import annotations

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from colibri_aio.cluster.board import ReplicaBoard, board

ROUTE_TO = "route_to"  # the keyword of a replica method's call that names the replica


class PinnedRouter(RequestRouter):
    """Routes a request to the replica its ``route_to`` keyword names, else to any replica with room."""

    @property
    def _board(self) -> ReplicaBoard:
        return board(self._deployment_id.app_name, self._deployment_id.name)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self._board.set({r.replica_id.unique_id for r in replicas})

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._board.discard(replica_id.unique_id)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is None:
            return [candidate_replicas]
        # Ray retries a request whose chosen replicas are all full; without this it retries at once, in a loop
        # that never lets its event loop run (so nothing could ever free up).
        pending_request.routing_context.should_backoff = True
        wanted = pending_request.kwargs.get(ROUTE_TO)
        pinned = [r for r in candidate_replicas if r.replica_id.unique_id == wanted]
        return [pinned or candidate_replicas]
