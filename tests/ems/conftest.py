"""Fixtures: real EMS pools (controller + MP servers as processes on 127.0.0.1)."""

import glob
import shutil
import tempfile

import pytest

from matrixinfer.ems import EMSClient, LocalCluster
from matrixinfer.ems import local


@pytest.fixture(scope="session", autouse=True)
def shm_left_as_found():
    """The suite leaves /dev/shm as it found it: no arena or index of a server it started
    (ids carry each pool's tag; other users' pools on this machine are not ours to judge)."""
    before, tags = set(glob.glob("/dev/shm/mi-ems-*")), []
    start = local.LocalCluster.start

    def recording_start(self):
        tags.append(self.tag)
        return start(self)

    local.LocalCluster.start = recording_start
    yield
    local.LocalCluster.start = start
    left = [p for p in set(glob.glob("/dev/shm/mi-ems-*")) - before if "mi-ems-test-" in p or any(t in p for t in tags)]
    assert left == [], f"tests left shared memory behind: {left}"


def _cluster(request, **kw):
    root = tempfile.mkdtemp(prefix="ems-test-")
    cl = LocalCluster(root=root, **kw)

    def fin():
        cl.close()
        shutil.rmtree(root, ignore_errors=True)

    request.addfinalizer(fin)  # registered before start: a failed start is still cleaned up
    cl.start()
    return cl


@pytest.fixture(scope="module")
def pool(request):
    """Two MP servers shared by the read/write tests of one module (starting costs ~1 s)."""
    return _cluster(request, n_servers=2, dram_bytes=32 << 20)


@pytest.fixture
def fresh_pool(request):
    """A private pool for tests that kill, restart or fill servers."""
    marker = request.node.get_closest_marker("pool")
    return _cluster(request, **(marker.kwargs if marker else {}))


@pytest.fixture
def client_factory(request):
    clients = []

    def make(cluster, namespace="default", **kw):
        c = EMSClient(cluster.controller, namespace, **kw)
        clients.append(c)
        return c

    request.addfinalizer(lambda: [c.close() for c in clients])
    return make


def pytest_configure(config):
    config.addinivalue_line("markers", "pool(**kw): LocalCluster arguments for fresh_pool")
