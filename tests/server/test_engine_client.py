"""The front end's engine handle keeps its books straight (a sequence it could not send leaves
no route and no queue slot behind, `abort_all` ends every sequence in flight), and its
supervisor replaces a lost engine until losses come too often."""

from __future__ import annotations

import asyncio

import pytest

from ember.sampling_params import SamplingParams
from ember.server.config import RestartPolicy
from ember.server.engine_client import EngineClient, EngineDeadError, EngineState, _Route
from ember.server.engine_supervisor import EngineSupervisor
from ember.server.inbox import Inbox


def ready_client() -> EngineClient:
    client = EngineClient([])
    client.state = EngineState.READY  # as if loaded; no process, no socket
    return client


def test_a_sequence_that_cannot_be_sent_takes_no_queue_slot():
    async def scenario() -> None:
        client = ready_client()
        inbox = Inbox()
        params = SamplingParams(max_tokens=4)
        params.seed = 2**64  # past what the engine's messages carry
        with pytest.raises(ValueError, match="cannot be sent"):
            client.submit("r1", "m", [1, 2], params, inbox, 0)
        with pytest.raises(EngineDeadError):  # the socket is gone: the send itself fails
            client.submit("r2", "m", [1, 2], SamplingParams(max_tokens=4), inbox, 0)
        assert client.num_waiting("m") == 0 and client.num_in_flight == 0

    asyncio.run(scenario())


def test_abort_all_ends_every_sequence_in_flight():
    async def scenario() -> None:
        client = ready_client()
        inbox = Inbox()
        for index, request_id in enumerate(("a", "b")):
            client._routes[request_id] = _Route(inbox, index, "m")
        client._num_waiting["m"] = 2
        assert client._requests is None  # nothing to tell the engine: the sequences still end
        assert client.abort_all("the server is shutting down") == 2
        items = await inbox.take()
        assert [index for index, _ in items] == [0, 1]
        assert all(isinstance(error, EngineDeadError) for _, error in items)
        assert client.num_waiting("m") == 0 and client.num_in_flight == 0

    asyncio.run(scenario())


class LosingClient:
    """An engine that loads, then is lost again and again."""

    def __init__(self) -> None:
        self.restarts = 0
        self.failure = "the engine process exited with code -9"

    async def wait_loaded(self) -> bool:
        return True

    async def wait_dead(self) -> None:
        await asyncio.sleep(0)

    async def restart(self) -> None:
        self.restarts += 1


def test_the_supervisor_restarts_a_lost_engine_until_it_is_lost_too_often():
    client, exits, ready = LosingClient(), [], []
    supervisor = EngineSupervisor(
        client,
        on_first_ready=lambda: ready.append(True),
        request_exit=exits.append,
        stopping=lambda: False,
        policy=RestartPolicy(backoff_s=(0.0,), window_s=60.0, max_losses=3),
    )
    asyncio.run(asyncio.wait_for(supervisor.run(), 10))
    assert ready == [True] and client.restarts == 3 and exits == [1]


def test_the_supervisor_does_not_restart_while_the_server_stops():
    client, exits = LosingClient(), []
    supervisor = EngineSupervisor(
        client, lambda: None, exits.append, stopping=lambda: True, policy=RestartPolicy()
    )
    asyncio.run(asyncio.wait_for(supervisor.run(), 10))
    assert client.restarts == 0 and exits == []
