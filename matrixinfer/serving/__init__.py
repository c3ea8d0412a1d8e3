"""matrixinfer.serving: the OpenAI-compatible token service (HTTP API, tenants and API keys,
per-tenant metering, quotas and Prometheus metrics) over any async engine."""

from matrixinfer.serving.api_server import build_app
from matrixinfer.serving.async_engine import AsyncLLMEngine, EngineClient, EngineStats, GenerateRequest
from matrixinfer.serving.ledger import Prices, UsageLedger
from matrixinfer.serving.tenants import Tenant, TenantStore

__all__ = ["build_app", "AsyncLLMEngine", "EngineClient", "EngineStats", "GenerateRequest", "Prices",
           "UsageLedger", "Tenant", "TenantStore"]
