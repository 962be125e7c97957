from __future__ import annotations

import os

import pytest

from examples.two_node import forkserver

# Nodes the tests start themselves are forked from a server that has imported torch once, not
# started cold: ~2 s of CPU less per node, much of the suite's time on two cores
# (examples/two_node/forkserver.py). The demos, benchmarks and fronts the tests run start their
# nodes cold, as a user's do. KVO_FORK_SERVER=0 starts every node cold.
if os.environ.get(forkserver.ENV) != "0":
    forkserver.enable()


def pytest_sessionstart(session: pytest.Session) -> None:
    """Start the fork server now (it imports while the first tests run), but not in pytest-xdist's
    controller, which runs no test."""
    controller = bool(getattr(session.config.option, "numprocesses", None)) and not hasattr(session.config, "workerinput")
    if not controller:
        forkserver.server()


def pytest_sessionfinish(session: pytest.Session) -> None:
    forkserver.shutdown()

from tests.group_harness import make_group as make_group  # a GEN of any TP size in this process


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    """Orchestration code runs on both backends; ucxx tests override this with asyncio only."""
    return request.param


@pytest.fixture
async def harness_factory(anyio_backend: str):
    """Yields ``make(config=None, **transport_kw) -> Harness`` with each engine's receive group
    running in this test's event loop; after the test, every engine must be at rest."""
    import anyio

    from tests.harness import make_harness

    made = []
    async with anyio.create_task_group() as tg:

        async def make(config=None, **kw):
            h = make_harness(config, **kw)
            await h.engine.start(tg)
            made.append(h)
            return h

        try:
            yield make
            for h in made:
                await h.settle()
                h.engine.step()  # drain what the last settle delivered
                problems = h.engine.rest_problems()
                assert not problems, f"engine not at rest after the test: {problems}"
        finally:
            for h in made:
                h.engine.close()


# The longest files first (seconds of test time in a run of the whole suite, 2026-12-07): the
# suite runs with `--dist loadfile`, which hands whole files to the workers in collection order,
# so a long file collected last (they are late in the alphabet) kept one worker busy alone at the
# end. The rest keep their order; so do the tests inside each file.
LONG_FILES = ("test_faults.py", "test_tp_two_node.py", "test_ucx_transport.py", "test_tp_heal.py", "test_two_node.py",
              "test_control.py", "test_bench.py", "test_etcd_membership.py", "test_sim.py", "test_one_step.py",
              "test_serve_tp.py")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
