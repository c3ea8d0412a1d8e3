"""The asyncio client against real servers."""

import asyncio
import os

from matrixinfer.ems import AsyncEMSClient, EMSClient


def test_async_client_puts_and_gets_concurrently(pool):
    """Concurrent awaits of put/get/get_many/exists/delete agree with the sync client's view."""

    async def main():
        c = await AsyncEMSClient.connect(pool.controller, "async")
        vals = {f"a{i}": os.urandom(20_000 + i) for i in range(40)}
        assert await c.put_many(vals) == [True] * 40
        got = await asyncio.gather(*(c.get(k) for k in vals))
        assert list(got) == list(vals.values())
        assert await c.get_many([*vals, "none"]) == [*vals.values(), None]
        assert await c.exists(["a0", "none"]) == [True, False]
        assert await c.delete("a0") and await c.get("a0") is None
        await c.close()
        return vals

    vals = asyncio.run(main())
    sync = EMSClient(pool.controller, "async", zero_copy=False)
    assert sync.get("a1") == vals["a1"]
    sync.close()


def test_async_client_misses_when_the_pool_is_empty(tmp_path, request):
    """No servers: async gets are None and puts False, no exception."""
    from matrixinfer.ems import LocalCluster

    cl = LocalCluster(n_servers=0, root=str(tmp_path))
    request.addfinalizer(cl.close)
    cl.start()

    async def main():
        c = await AsyncEMSClient.connect(cl.controller, "x")
        assert await c.put("k", b"v") is False and await c.get("k") is None
        await c.close()

    asyncio.run(main())


def test_async_same_host_gets_need_no_request(pool):
    """The async client also reads DRAM values through the shared index: no get request."""

    async def main():
        c = await AsyncEMSClient.connect(pool.controller, "async-zc")
        vals = {f"q{i}": os.urandom(5000) for i in range(10)}
        assert all(await c.put_many(vals))
        sent, real = [], c._call

        async def counting(sid, header, *a):
            sent.append(header["op"])
            return await real(sid, header, *a)

        c._call = counting
        assert await c.get_many(list(vals)) == list(vals.values())
        await c.close()
        return sent

    assert not {"get", "get_many"} & set(asyncio.run(main()))
