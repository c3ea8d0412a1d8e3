"""A live token service for the tests: a tiny checkpoint with a byte-level tokenizer, the
real AsyncLLMEngine, the FastAPI app under uvicorn on a free loopback port."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import uvicorn

from matrixinfer.serving import AsyncLLMEngine, TenantStore, UsageLedger, build_app


class LiveServer:
    """uvicorn in a thread on 127.0.0.1, port picked by the OS; always stopped by the fixture."""

    def __init__(self, app):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()


@pytest.fixture(scope="session")
def engine(text_checkpoint):
    eng = AsyncLLMEngine.from_model(text_checkpoint[0], model_name="tiny", dtype="float32", block_size=4,
                                    max_model_len=128, max_num_seqs=64)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="session")
def bundled_engine():
    """The bundled model (models/matrixinfer-tiny-moe, its real tokenizer and chat template),
    with a context long enough for tool definitions; shared by the modules that need it."""
    from matrixinfer.config import DEFAULT_MODEL

    eng = AsyncLLMEngine.from_model(DEFAULT_MODEL, model_name="tiny-moe", dtype="float32", max_model_len=1024)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def bundled_server(bundled_engine):
    """A plain server (no keys) over the bundled engine."""
    server = LiveServer(build_app(bundled_engine))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def bundled_client(bundled_server):
    """The official `openai` client of bundled_server."""
    import openai

    return openai.OpenAI(base_url=bundled_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def start_service(engine, db_path):
    """(server, tenants, ledger) for an app over `engine` with its own key/ledger database."""
    tenants, ledger = TenantStore(db_path), UsageLedger(db_path)
    return LiveServer(build_app(engine, tenants, ledger)), tenants, ledger


@pytest.fixture(scope="module")
def service(engine, tmp_path_factory):
    server, tenants, ledger = start_service(engine, tmp_path_factory.mktemp("db") / "serving.db")
    yield server, tenants, ledger
    server.stop()
    tenants.close()
    ledger.close()
