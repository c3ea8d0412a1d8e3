"""matrixinfer.ems: the Elastic Memory Service (the Caching pool of the PDC architecture).

Public surface: the clients, the context-cache and model-cache helpers, and LocalCluster
to run a pool on one machine. Roles run as processes: `matrixinfer ems controller|server`.
"""

from .aclient import AsyncEMSClient
from .client import EMSClient
from .context_cache import ContextCache
from .local import LocalCluster
from .protocol import EMSError

__all__ = ["AsyncEMSClient", "ContextCache", "EMSClient", "EMSError", "LocalCluster"]
