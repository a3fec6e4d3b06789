"""The HTTP API fuzzed from its own OpenAPI schema (schemathesis) against a REAL ``kernelctl serve``.

Every operation of ``/openapi.json`` gets schema-valid and schema-violating requests (hypothesis), sent with
valid credentials (a node token on the agent endpoints, an operator token elsewhere) to a controller on a
fresh PostgreSQL database that holds a registered node. No request may produce a 5xx, and every response
must match the schema it declares (body and content type). Bounded: a few examples per operation and mode.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import content_type_conformance, response_schema_conformance

from tests import dbutil
from tests.controller.serverutil import ControllerProcess, inventory

pytestmark = [pytest.mark.postgres, pytest.mark.slow]
EXAMPLES = 8  # per operation and generation mode
CHECKS = [not_a_server_error, response_schema_conformance, content_type_conformance]


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    from kernelpack.signing import generate_keypair

    tmp = tmp_path_factory.mktemp("fuzz")
    key = generate_keypair(tmp / "keys")
    trusted = tmp / "trusted"
    trusted.mkdir()
    (trusted / key.public_path.name).write_bytes(key.public_path.read_bytes())
    with dbutil.fresh_database("postgres", tmp) as url, \
            ControllerProcess(url, tmp, trusted_keys_dir=trusted, max_bundle_bytes=1 << 20,
                             extra_env={"KERNELCTL_API_DOCS": "true"}) as ctl:
        with ctl.client("enroll") as c:
            r = c.post("/v1/agents/register", json={"node_name": "fuzz-node", "inventory": inventory()})
            assert r.status_code == 200, r.text
            ctl.node_token = r.json()["node_token"]  # type: ignore[attr-defined]
        yield ctl


def _fuzz_operation(op, base_url: str, headers: dict[str, str], mode: GenerationMode) -> str | None:  # type: ignore[no-untyped-def]
    """Send up to EXAMPLES generated requests; the distinct failures (with a curl line each) or None."""
    strategy = op.as_strategy(generation_mode=mode, headers=headers)

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(strategy)
    def run(case) -> None:  # type: ignore[no-untyped-def]
        case.call_and_validate(base_url=base_url, headers=headers, checks=CHECKS, timeout=30)

    try:
        run()
    except Unsatisfiable:  # nothing in this operation can be made schema-violating (no inputs to negate)
        assert mode is GenerationMode.NEGATIVE, f"{op.label}: no valid request could be generated"
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # schemathesis' FailureGroup (an exception group): checks failed
        return f"{op.label} [{mode.value}]: {exc}\n" + "\n".join(
            str(e)[:1500] for e in getattr(exc, "exceptions", [exc]))
    return None


def test_api_fuzzed_from_openapi_has_no_server_errors_or_schema_violations(controller: ControllerProcess) -> None:
    schema = schemathesis.openapi.from_url(controller.url + "/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    assert len(operations) >= 15, [o.label for o in operations]  # the whole API is described
    operator = {"Authorization": f"Bearer {controller.tokens['operator']}"}
    node = {"Authorization": f"Bearer {controller.node_token}"}  # type: ignore[attr-defined]
    failures = []
    for op in operations:
        headers = node if op.path.startswith(("/v1/agents", "/v1/bundles/{name}/{version}/content")) else operator
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            failure = _fuzz_operation(op, controller.url, headers, mode)
            if failure:
                failures.append(failure)
    assert controller.running, controller.log_tail()
    assert httpx.get(controller.url + "/healthz", timeout=10).status_code == 200
    assert not failures, "\n\n".join(failures)
    assert "Traceback" not in controller.log_text(), controller.log_tail(80)
