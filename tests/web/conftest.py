import pytest

from tests.web.server import ServerProcess


@pytest.fixture(scope="session")
def smol_server(smollm2_path):
    """The default model served twice, as "smol" and "smol-b" (two models make routing observable)."""
    server = ServerProcess(["--model", str(smollm2_path), "--name", "smol",
                            "--model", str(smollm2_path), "--name", "smol-b"], wait_models=2)
    yield server
    server.stop()
