"""Property-based fuzzing of the API from its own OpenAPI spec (schemathesis): valid and
invalid requests generated from /openapi.json never get a 5xx and never hang; answers use
documented status codes, content types and response schemas, and invalid data is refused.

`positive_data_acceptance` is not checked: a schema-valid request can still be refused with
a documented 400 (prompt plus max_tokens over the context), which the schema cannot say.
Generation is bounded: the engine here has a 24-token context, so no request runs long."""

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (content_type_conformance, negative_data_rejection, not_a_server_error,
                                 response_schema_conformance, status_code_conformance)

from matrixinfer.serving import AsyncLLMEngine, build_app
from tests.serving.conftest import start_service

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]


@pytest.fixture(scope="module")
def fuzz_server(text_checkpoint, tmp_path_factory):
    engine = AsyncLLMEngine.from_model(text_checkpoint[0], model_name="tiny", dtype="float32", block_size=4,
                                       max_model_len=24, max_num_seqs=32)
    server, tenants, ledger = start_service(engine, tmp_path_factory.mktemp("fuzz") / "serving.db")
    tenants.add_key("fuzz", key=FUZZ_KEY)
    yield server
    server.stop()
    engine.shutdown()
    tenants.close()
    ledger.close()


class _SchemaOnly:
    """Enough of an engine to build the app and read its OpenAPI document at import time."""

    model_name, max_model_len, tokenizer, vocab_size = "tiny", 24, None, 300


schema = schemathesis.openapi.from_dict(build_app(_SchemaOnly()).openapi())
FUZZ_KEY = "mi-fuzz-tenant-test-key"


@schema.auth()
class _BearerKey:
    """Requests carry the fuzz tenant's key, except the ones schemathesis sends without auth
    on purpose (those must get 401)."""

    def get(self, case, ctx):
        return FUZZ_KEY

    def set(self, case, data, ctx):
        case.headers = {**(case.headers or {}), "Authorization": f"Bearer {data}"}


@schema.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_api_has_no_server_errors(case, fuzz_server):
    """Every generated request is answered within 20 s by a documented, well-formed response
    that is never a 5xx."""
    case.call_and_validate(base_url=fuzz_server.url, checks=CHECKS, timeout=20)


def test_served_spec_is_the_fuzzed_spec(fuzz_server):
    """The spec fuzzed above is the one the live server serves at /openapi.json."""
    import httpx

    assert httpx.get(fuzz_server.url + "/openapi.json").json() == schema.raw_schema
