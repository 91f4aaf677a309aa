"""Property-based fuzzing of the server from its own /openapi.json (schemathesis): valid and invalid bodies for every
operation, on 127.0.0.1 only, a bounded number of examples; no answer may be a 5xx."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
if not hasattr(schemathesis, "pytest") or not hasattr(schemathesis.pytest, "from_fixture"):
    pytest.skip("needs schemathesis >= 4", allow_module_level=True)

from hypothesis import HealthCheck, Phase, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from orinfer import LLM  # noqa: E402
from orinfer.server.app import ServerLimits, build_app  # noqa: E402
from orinfer.server.cli import BackgroundServer  # noqa: E402


@pytest.fixture(scope="module")
def fuzz_server(tiny_dir):
    llm = LLM(tiny_dir, dtype="float32", device="cpu", progress=False, max_model_len=256)
    # Small limits keep every accepted request cheap: at most 8 tokens, 2 choices.
    app = build_app(llm, "tiny", limits=ServerLimits(max_tokens=8, max_n=2, max_sequences=4, max_prompts=4))
    with BackgroundServer(app) as bg:
        yield bg


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@pytest.mark.slow  # ~40 examples per route over 12 routes (~30 s): CI's slow tier
@schema.parametrize()
@settings(max_examples=40, deadline=None, database=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, fuzz_server):
    response = case.call(base_url=fuzz_server.url, timeout=30)
    case.validate_response(response, checks=[not_a_server_error])
    assert response.status_code < 500, response.text[:500]
