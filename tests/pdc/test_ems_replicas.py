"""The PDC stack's EMS replicas: the deployment file's `ems.replicas` and the launcher's
namespace definition against a real controller process."""

import logging

import pytest

from matrixinfer.deployment import deployment_from_dict
from matrixinfer.ems import LocalCluster
from matrixinfer.ems.protocol import call_once
from matrixinfer.pdc.launch import define_namespaces

PDC = {"model": "m", "colocated": False, "prefill": {"instances": 1}, "decode": {"instances": 1}}


def test_deployment_file_reads_ems_replicas_and_refuses_bad_ones():
    """`ems: {servers: 2, replicas: 2}` reaches the Deployment; 0, a string or an unknown key
    under ems is a ValueError naming the field."""
    d = deployment_from_dict({**PDC, "ems": {"servers": 2, "replicas": 2}})
    assert (d.ems_servers, d.ems_replicas) == (2, 2)
    assert deployment_from_dict({**PDC, "ems": {"servers": 2}}).ems_replicas == 1
    for bad, field in (({"replicas": 0}, "ems.replicas"), ({"replicas": "2"}, "ems.replicas"), ({"copies": 2}, "ems.copies")):
        with pytest.raises(ValueError, match=field):
            deployment_from_dict({**PDC, "ems": {"servers": 2, **bad}})


@pytest.mark.timeout(60)
def test_launcher_gives_the_stacks_namespaces_their_replicas(tmp_path, request, caplog):
    """define_namespaces makes kv and models replicated, even over an implicit (first-use)
    creation; a namespace an operator defined explicitly is kept, with a warning."""
    cl = LocalCluster(n_servers=0, root=str(tmp_path))
    request.addfinalizer(cl.close)
    cl.start()
    call_once(cl.controller, {"op": "ns_create", "name": "kv", "if_absent": True})  # an instance got there first
    call_once(cl.controller, {"op": "ns_create", "name": "tenant", "dram_bytes": 1 << 20})
    with caplog.at_level(logging.WARNING):
        define_namespaces(cl.controller, ["kv", "models", "tenant"], 2)
    ns = call_once(cl.controller, {"op": "ns_list"})["namespaces"]
    assert (ns["kv"]["replicas"], ns["models"]["replicas"], ns["tenant"]["replicas"]) == (2, 2, 1)
    assert "'tenant' keeps its 1 replica" in caplog.text
