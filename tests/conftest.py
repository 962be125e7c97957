from __future__ import annotations

import pytest

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
