"""The /ui page in a real headless chromium (Debian's, through chromedriver) against a real ``kernelctl serve``
on loopback and PostgreSQL, with simulated nodes speaking the agent protocol and the real judge deciding.

A viewer signs in, follows a running rollout (the page updates by itself: samples grow, the judge advances
the step and the bounds plot marks the decision) and has no operator controls (the API refuses its promote
with 403 too); an operator promotes from the page through the expected-step guard, pauses, resumes and
rolls back with a reason that lands in the changelog; every node-supplied string is shown as text. Screenshots
of the main pages are written to test-artifacts/ui/ (the path is printed).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests import dbutil
from tests.controller.serverutil import ControllerProcess, TestBundles, build_test_bundles
from tests.e2e.uiutil import SimFleet, SimNode, artifacts_dir, full_page_screenshot, start_chromium

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

XSS_GPU = '<img src=x onerror="window.__kctl_xss=1">GPU'
STEP = {"bake_seconds": 3600, "min_samples": 5, "deadline_seconds": 7200}
PLAN_A = {  # step 1 advances on its own (short bake); the later steps hold until an operator promotes
    # 8 samples: the page must show step 1 holding before it advances (with 5, faster CPU trials advanced it
    # before the test read the step once)
    "steps": [{"nodes": 1, "bake_seconds": 5, "min_samples": 8, "deadline_seconds": 600},
              {"percent": 50, **STEP}, {"percent": 100, **STEP}],
    "latency_margin": 0.10, "max_fleet_share": 1.0, "max_label_share": 1.0,
    "trial_interval_seconds": 0, "hold_verdict_seconds": 1,
}
PLAN_B = {"steps": [{"nodes": 1, **STEP}, {"percent": 100, **STEP}], "latency_margin": 0.05,
          "max_fleet_share": 1.0, "max_label_share": 1.0, "trial_interval_seconds": 0, "hold_verdict_seconds": 1}


def wait_for(what: str, pred: Callable[[], Any], timeout: float = 30.0, period: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = pred()
        except Exception as exc:  # a stale element or a page in the middle of a re-render: look again
            last = exc
        if last and not isinstance(last, Exception):
            return last
        time.sleep(period)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def pct(text: str) -> float:
    """"+10.0%" -> 10.0"""
    return float(text.strip().rstrip("%"))


class World:
    """The controller, its fleet, the operator's API client and the browser, shared by the module's tests."""

    def __init__(self, ctl: ControllerProcess, fleet: SimFleet, bundles: TestBundles, driver: Any, shots: Path):
        self.ctl, self.fleet, self.bundles, self.driver, self.shots = ctl, fleet, bundles, driver, shots
        self.api = ctl.client("operator")
        self.rollout_a: int | None = None

    # ------------------------------------------------------------------------------ browser helpers
    def open(self, fragment: str) -> None:
        self.driver.get(f"{self.ctl.url}/ui/#{fragment}")

    def sign_in(self, who: str) -> None:
        from selenium.webdriver.common.by import By

        d = self.driver
        d.get(f"{self.ctl.url}/ui/#/rollouts")
        d.execute_script("sessionStorage.clear()")
        d.refresh()  # a fresh page: nothing of the previous session left in memory
        box = wait_for("the sign-in form", lambda: d.find_element(By.ID, "token"))
        box.send_keys(self.ctl.tokens[who])
        d.find_element(By.ID, "login-submit").click()
        wait_for(f"signed in as {who}", lambda: d.find_element(By.ID, "role").text == {"operator": "operator"}.get(who, "viewer"))

    def el(self, css: str, timeout: float = 15.0) -> Any:
        from selenium.webdriver.common.by import By

        return wait_for(f"element {css}", lambda: self.driver.find_element(By.CSS_SELECTOR, css), timeout)

    def els(self, css: str) -> list[Any]:
        from selenium.webdriver.common.by import By

        return self.driver.find_elements(By.CSS_SELECTOR, css)

    def accept_confirm(self) -> str:
        from selenium.webdriver.support import expected_conditions as ec
        from selenium.webdriver.support.ui import WebDriverWait

        alert = WebDriverWait(self.driver, 5).until(ec.alert_is_present())
        text = alert.text
        alert.accept()
        return text

    def shot(self, name: str) -> Path:
        path = self.shots / f"{name}.png"
        full_page_screenshot(self.driver, path)
        assert path.stat().st_size > 10_000, f"{path} looks empty"
        return path

    # ------------------------------------------------------------------------------ API helpers
    def rollout(self, rid: int) -> dict[str, Any]:
        r = self.api.get(f"/v1/rollouts/{rid}")
        r.raise_for_status()
        return r.json()

    def promote(self, rid: int, **body: Any) -> httpx.Response:
        """An operator promote through the API. A step promotion names the step it moves from (the API's guard);
        a full promotion does not (the controller may begin a pending rollout between a read and the promote)."""
        if not body.get("full"):
            body.setdefault("from_step", self.rollout(rid)["promote_from_step"])
        return self.api.post(f"/v1/rollouts/{rid}/promote", json=body)

    def start_rollout(self, version: str, plan: dict[str, Any], reason: str) -> int:
        r = self.api.post("/v1/rollouts", json={"bundle": self.bundles.ref(version), "plan": plan, "reason": reason})
        assert r.status_code == 201, r.text
        return r.json()["id"]

    def audit(self, **filters: Any) -> list[dict[str, Any]]:
        r = self.api.get("/v1/audit", params=filters)
        r.raise_for_status()
        return r.json()


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("ui")
    bundles = build_test_bundles(tmp / "bundles", versions=("1.0.0", "1.1.0", "1.2.0", "1.3.0", "1.4.0"),
                                 archs=("sm_80", "sm_90"))
    shots = artifacts_dir()
    print(f"\nUI screenshots: {shots}")
    driver = start_chromium(tmp)
    with dbutil.fresh_database("postgres", tmp) as url, \
            ControllerProcess(url, tmp, trusted_keys_dir=bundles.keys_dir, tick_seconds=0.5) as ctl:
        nodes = [SimNode(f"ui-a100-{i}", "sm_80", "535.183.01", "NVIDIA A100-SXM4-80GB") for i in range(1, 4)]
        nodes += [SimNode(f"ui-h100-{i}", "sm_90", "550.90.07", "NVIDIA H100 80GB HBM3") for i in range(1, 4)]
        nodes[-1].gpu_name = XSS_GPU  # a node-supplied string with markup in it
        fleet = SimFleet(ctl, nodes, noise=0.005, trial_every=0.2)
        fleet.register()
        fleet.start()
        w = World(ctl, fleet, bundles, driver, shots)
        try:
            for v in ("1.0.0", "1.1.0", "1.2.0", "1.3.0", "1.4.0"):
                assert w.api.post("/v1/bundles", content=bundles.files[v].read_bytes()).status_code == 201
            # the baseline: 1.0.0 stable everywhere (the operator promotes it fully; nothing to judge against)
            base = w.start_rollout("1.0.0", {"steps": [{"percent": 100, "bake_seconds": 0, "min_samples": 1}],
                                             "max_fleet_share": 1.0, "max_label_share": 1.0}, "ui test baseline")
            r = w.promote(base, full=True, reason="ui test baseline")
            assert r.status_code == 200, r.text
            wait_for("1.0.0 active on every node", lambda: set(fleet.active_versions().values()) == {"1.0.0"})
            yield w
        except BaseException:
            with open(shots / "failure.png", "wb") as fh:
                fh.write(driver.get_screenshot_as_png())
            raise
        finally:
            with contextlib.suppress(Exception):  # diagnostics only
                (shots / "browser-console.json").write_text(json.dumps(driver.get_log("browser"), indent=1))
            driver.quit()
            fleet.stop()
            w.api.close()
            (shots / "controller.log").write_text(ctl.log_text()[-200_000:])


@pytest.fixture(scope="module")
def rollout_a(world: World) -> int:
    """A rollout of 1.1.0 over 1.0.0 (started once for the module)."""
    if world.rollout_a is None:
        world.rollout_a = world.start_rollout("1.1.0", PLAN_A, "ui test: candidate 1.1.0")
    return world.rollout_a


@pytest.fixture(autouse=True)
def last_page(request: pytest.FixtureRequest, world: World) -> Iterator[None]:
    """After each test, the page as it was left (for a failing test: where it stopped)."""
    yield
    with contextlib.suppress(Exception):  # diagnostics only
        world.driver.save_screenshot(str(world.shots / f"last-{request.node.name}.png"))


def test_sign_in_refuses_unknown_and_agent_tokens(world: World) -> None:
    from selenium.webdriver.common.by import By

    d = world.driver
    world.open("/rollouts")
    d.execute_script("sessionStorage.clear()")
    d.refresh()
    for token, expect in (("kctl_not_a_token_at_all_0000", "unknown token"),
                          (world.ctl.tokens["enroll"], "may not use the UI")):
        box = world.el("#token")
        box.clear()
        box.send_keys(token)
        d.find_element(By.ID, "login-submit").click()
        wait_for(f"sign-in refusal {expect!r}", lambda e=expect: e in d.find_element(By.ID, "login-status").text)
        assert d.execute_script("return sessionStorage.getItem('kernelctl.token')") is None
        assert world.els("#nav a") and not d.find_element(By.ID, "nav").is_displayed()
    world.shot("sign-in")


def test_viewer_follows_a_running_rollout_and_cannot_promote(world: World, rollout_a: int) -> None:
    from selenium.webdriver.common.by import By

    d = world.driver
    world.sign_in("viewer")
    world.open("/rollouts")
    row = world.el(f'tr[data-rollout="{rollout_a}"]')
    assert "llm-fused@1.1.0" in row.text
    world.shot("rollouts")
    row.find_element(By.CSS_SELECTOR, "a").click()
    wait_for("the rollout page", lambda: d.find_element(By.ID, "rollout-state"))
    # read-only: no operator controls at all for a viewer
    assert world.els("#btn-promote") == [] and world.els("#ops") == []
    assert "operator token" in world.el("#read-only").text

    # live: while the judge holds step 1 the plot gains points; then the judge advances and the page shows it
    def points() -> int:
        plots = world.els('svg.kc-plot[data-kind="latency_aggregate"][data-metric$=":mean"]')
        return min((int(p.get_attribute("data-bounds")) for p in plots), default=0) if len(plots) == 2 else 0

    # the step as the page first showed it: under load the judge may already have advanced (then the live
    # follow of the advance cannot be watched, only its result)
    step0 = int(world.el("#rollout-step").get_attribute("data-step"))
    updates0 = int(world.el("#updated").get_attribute("data-updates"))
    first = wait_for("bounds plots with the deciding bound in both strata", lambda: points() >= 2 and points(), 30)
    if step0 == 0:
        wait_for("more verdicts in the plot", lambda: points() > first, 30)
    wait_for("the judge's advance to step 2 on the page",
             lambda: int(world.el("#rollout-step").get_attribute("data-step")) == 1, 90)
    assert step0 in (0, 1)
    if step0 == 0:
        assert int(world.el("#updated").get_attribute("data-updates")) > updates0
    assert world.rollout(rollout_a)["step_index"] == 1  # the page shows what the API says
    wait_for("an advance decision marked in the plots",
             lambda: len(world.els('svg.kc-plot .kc-decision[data-decision="advance"]')) >= 2, 20)
    # the page re-renders its plots live: read them in one script call (elements found one by one went stale
    # between the lookup and the read in one suite run)
    plots = d.execute_script("""return [...document.querySelectorAll('svg.kc-plot[data-kind="latency_aggregate"]')]
        .map(s => ({deciding: s.querySelectorAll('polyline.kc-deciding-bound').length,
                    band: s.querySelectorAll('polygon.kc-band').length,
                    labels: [...s.querySelectorAll('.kc-grid text')].map(t => t.textContent.trim())
                                .filter(t => t.endsWith('%')),
                    estimate: s.querySelectorAll('polyline.kc-estimate').length,
                    margin: s.querySelectorAll('polyline.kc-margin').length}));""")
    assert len(plots) >= 2, plots
    for plot in plots:
        # one-sided latency tests: the deciding bound as a line, no two-sided band (issue 27 item 7)
        assert plot["deciding"], "no deciding bound drawn"
        assert not plot["band"], "a two-sided band on a one-sided test"
        labels = plot["labels"]
        assert labels and all(len(t.rstrip("%").lstrip("+-").replace(".", "")) <= 3 for t in labels), labels
        assert plot["estimate"], "no estimate line"
        assert plot["margin"], "no margin line"
    margin = world.els('svg.kc-plot[data-kind="latency_aggregate"][data-metric$=":mean"] .kc-margin-label')[0].text
    want = PLAN_A["latency_margin"] * 100  # the judge's log margin, labelled as the percent it means
    assert margin.startswith("margin +") and abs(pct(margin.split()[-1]) - want) < 0.01, margin
    # the metrics table carries the judge's estimate, bounds and margin for the stratum
    agg = world.els('svg.kc-plot[data-kind="latency_aggregate"][data-metric$=":mean"]')[0].get_attribute("data-metric")
    cells = world.els(f'.stratum-card tr[data-metric="{agg}"] td')
    assert cells and abs(pct(cells[6].text) - want) < 0.01, [c.text for c in cells]
    # a cell (folded while passing): both arms' mean and p99
    cell = [td.get_attribute("textContent") for td in world.els('.stratum-card tr[data-metric="latency:bias_gelu@8:p99"] td')]
    assert cell and "mean" in cell[3] and "p99" in cell[4], cell
    world.shot("rollout-viewer")

    # the API, not only the page, refuses a viewer's promote (same token, from the page's own context)
    status = d.execute_async_script("""
        const done = arguments[arguments.length - 1];
        fetch(`/v1/rollouts/${arguments[0]}/promote`, {method: "POST", headers: {
          "Authorization": "Bearer " + sessionStorage.getItem("kernelctl.token"), "Content-Type": "application/json"},
          body: "{}"}).then((r) => done(r.status), (e) => done(String(e)));
    """, rollout_a)
    assert status == 403
    assert world.rollout(rollout_a)["step_index"] == 1


def test_operator_promotes_from_the_page_through_the_step_guard(world: World, rollout_a: int) -> None:
    from selenium.webdriver.common.by import By

    wait_for("rollout A at step 2", lambda: world.rollout(rollout_a)["step_index"] >= 1, 60)
    world.sign_in("operator")
    world.open(f"/rollouts/{rollout_a}")
    button = world.el("#btn-promote")
    wait_for("the promote button for step 2", lambda: button.text == "Promote from step 2" and button.is_enabled())
    world.shot("rollout-operator")

    # the page stops refreshing; another operator promotes meanwhile; the stale page's promote is refused
    world.driver.find_element(By.ID, "live").click()
    r = world.promote(rollout_a, reason="ui test: another operator")
    assert r.status_code == 200 and r.json()["step_index"] == 2, r.text
    world.el("#reason").send_keys("ui test: a stale page must not promote twice")
    button.click()
    if world.rollout(rollout_a).get("promote_from_step") is not None:  # the API's guard: the page asks first
        world.accept_confirm()
    result = wait_for("the guard's refusal", lambda: "refused" in world.el("#op-result").text and world.el("#op-result").text)
    assert "nothing was changed" in result, result
    assert world.rollout(rollout_a)["step_index"] == 2 and world.rollout(rollout_a)["state"] == "progressing"
    assert all(e["reason"] != "ui test: a stale page must not promote twice"
               for e in world.audit(action="rollout.*", limit=1000))
    world.el("#reason").clear()

    # live again: the page shows step 3; promote it with a reason
    world.driver.find_element(By.ID, "live").click()
    wait_for("the promote button for step 3", lambda: world.el("#btn-promote").text == "Promote from step 3")
    reason = "ui test: operator promotes step 3 from the page"
    world.el("#reason").send_keys(reason)
    world.el("#btn-promote").click()
    assert "from step 3" in world.accept_confirm()
    wait_for("promoted on the page", lambda: world.el("#rollout-state").get_attribute("data-state") == "promoted", 20)
    assert world.rollout(rollout_a)["state"] == "promoted"
    assert world.el("#btn-promote").is_enabled() is False
    mine = [e for e in world.audit(action="rollout.*", bundle="llm-fused@1.1.0") if e["reason"] == reason]
    assert mine and all(e["actor"] == "operator:test-operator" for e in mine), mine
    assert "rollout.promoted" in {e["action"] for e in mine}


def test_operator_pauses_resumes_and_rolls_back_with_a_reason(world: World, rollout_a: int) -> None:
    if world.rollout(rollout_a)["state"] not in ("promoted", "rolled_back"):  # run alone: finish A first
        world.promote(rollout_a, full=True, reason="ui test: finish A")
    rid = world.start_rollout("1.2.0", PLAN_B, "ui test: candidate 1.2.0")
    world.sign_in("operator")
    world.open(f"/rollouts/{rid}")
    state = lambda: world.el("#rollout-state").get_attribute("data-state")  # noqa: E731
    wait_for("rollout B progressing", lambda: state() == "progressing", 20)

    world.el("#reason").send_keys("ui test: pause to look")
    wait_for("pause enabled", lambda: world.el("#btn-pause").is_enabled())
    world.el("#btn-pause").click()
    wait_for("paused", lambda: state() == "paused", 15)
    assert world.rollout(rid)["state"] == "paused"
    world.el("#btn-resume").click()
    wait_for("progressing again", lambda: state() == "progressing", 15)

    # a rollback needs a reason: refused on the page without one, nothing sent
    world.el("#reason").clear()
    world.el("#btn-rollback").click()
    assert "needs a reason" in world.el("#op-result").text
    assert world.rollout(rid)["state"] == "progressing"
    reason = "ui test: rolled back from the page <b>by hand</b>"
    world.el("#reason").send_keys(reason)
    world.el("#btn-rollback").click()
    assert "every live stratum" in world.accept_confirm()
    wait_for("rolled back on the page", lambda: state() == "rolled_back", 20)
    reasons = wait_for("the strata say why", lambda: world.els("#strata .stratum-reason"))
    assert all(f"rolled_back: {reason}" == r.text for r in reasons) and len(reasons) == 2, [r.text for r in reasons]
    assert world.els("#strata b") == []  # the reason's markup is text
    world.shot("rollout-rolled-back")

    events = world.audit(action="rollout.rolled_back", bundle="llm-fused@1.2.0")
    assert [(e["actor"], e["reason"]) for e in events] == [("operator:test-operator", reason)]
    paused = world.audit(action="rollout.paused", bundle="llm-fused@1.2.0")
    assert [(e["actor"], e["reason"]) for e in paused] == [("operator:test-operator", "ui test: pause to look")]

    # the audit page with the CLI's filters shows the same event, reason as text (reached from the rollout page)
    world.el("#audit-link").click()
    wait_for("the rollout's audit trail", lambda: world.el("#audit-bundle").get_attribute("value") == "llm-fused@1.2.0")
    assert world.el('#audit tr[data-action="rollout.paused"]')
    world.el("#audit-action").clear()
    world.el("#audit-action").send_keys("rollout.rolled_back")
    world.el("#audit-submit").click()
    wait_for("only the rollback", lambda: {r.get_attribute("data-action") for r in world.els("#audit tr[data-action]")}
             == {"rollout.rolled_back"})
    row = world.el('#audit tr[data-action="rollout.rolled_back"]')
    assert reason in row.text and "operator:test-operator" in row.text
    assert world.els("#audit b") == []
    assert world.el("#audit-action").get_attribute("value") == "rollout.rolled_back"
    world.shot("audit")
    # a bad filter is the API's one-line 422, shown on the page
    world.open("/audit?since=yesterday-ish")
    assert "since" in world.el("#view .error").text


def test_a_partly_promoted_rollout_and_a_numeric_rollback_say_what_happened(world: World) -> None:
    """An operator rolls back one stratum from the page, then promotes the rest: the page says partly_promoted
    (not a green "promoted") with each stratum's outcome, and compat shows the version rolled back there. A
    numeric rollback shows the failing check: op, dtype, shape, check, error against tolerance, and the nodes."""
    a100, h100 = "sm_80/drv535/triton3.6.0", "sm_90/drv550/triton3.6.0"
    rid = world.start_rollout("1.3.0", PLAN_B, "ui test: candidate 1.3.0")
    world.sign_in("operator")
    world.open(f"/rollouts/{rid}")
    state = lambda: world.el("#rollout-state").get_attribute("data-state")  # noqa: E731
    wait_for("rollout C progressing", lambda: state() == "progressing", 20)
    world.el("#reason").send_keys("ui test: p99 regressed on A100")
    world.el(f'#rollback-strata input[value="{a100}"]').click()
    world.el("#btn-rollback").click()
    assert a100 in world.accept_confirm()
    wait_for("the A100 stratum rolled back", lambda: world.rollout(rid)["strata"] and {
        s["stratum"]: s["state"] for s in world.rollout(rid)["strata"]}[a100] == "rolled_back", 20)
    wait_for("promote enabled", lambda: world.el("#btn-promote").is_enabled())
    world.el("#reason").send_keys("ui test: ship the rest")
    world.el("#promote-full").click()
    world.el("#btn-promote").click()
    world.accept_confirm()
    wait_for("partly promoted on the page", lambda: state() == "partly_promoted", 20)
    badge = world.el("#rollout-state .badge")
    assert badge.text == "partly_promoted" and "st-partly_promoted" in badge.get_attribute("class")
    outcome = world.el("#rollout-outcome").text
    assert f"promoted on {h100}" in outcome and f"rolled back on {a100}" in outcome, outcome
    world.shot("rollout-partly-promoted")
    world.open("/compat")
    cell = world.el(f'td[data-cell="llm-fused@1.3.0 {a100}"]')
    assert "rolled_back" in cell.text and "eligible" not in cell.text.split("nodes")[0], cell.text
    assert "stable" in world.el(f'td[data-cell="llm-fused@1.3.0 {h100}"]').text

    world.fleet.numeric_faults["1.4.0"] = {"op": "bias_gelu", "dtype": "fp32", "shape": {"M": 8, "N": 1032},
                                           "max_abs_err": 0.317, "max_rel_err": 0.05, "within_tolerance": False,
                                           "kind": "golden"}
    rid = world.start_rollout("1.4.0", PLAN_B, "ui test: candidate 1.4.0 (numeric fault)")
    world.open(f"/rollouts/{rid}")
    wait_for("the numeric rollback", lambda: state() == "rolled_back", 30)
    blocks = wait_for("the failing checks", lambda: world.els("#strata .failure"))
    for b in blocks:
        assert "bias_gelu fp32 M=8 N=1032" in b.text and "(golden)" in b.text and "max_abs_err 0.317 > atol" in b.text
        assert "numeric_error report(s) from 1 node(s): ui-" in b.text, b.text
    reasons = [r.text for r in world.els("#strata .reason")]
    assert all("bias_gelu fp32 M=8 N=1032, golden check: max_abs_err 0.317" in r for r in reasons), reasons
    world.shot("rollout-numeric-rollback")


def test_nodes_and_compat_pages_show_node_data_as_text(world: World) -> None:
    d = world.driver
    world.sign_in("viewer")
    world.open("/nodes")
    row = world.el('tr[data-node="ui-h100-3"]')
    assert XSS_GPU in row.text  # the markup is shown as text
    assert world.els("#nodes img") == []
    assert d.execute_script("return window.__kctl_xss === undefined")
    assert len(world.els("#nodes tbody tr")) == 6
    a100 = world.el('tr[data-node="ui-a100-1"]').text
    assert "sm_80/drv535" in a100 and "llm-fused@" in a100
    world.shot("nodes")

    world.open("/compat")
    cell = world.el('td[data-cell="llm-fused@1.0.0 sm_80/drv535/triton3.6.0"]')
    api_rows = world.api.get("/v1/compat").json()
    want = next(r for r in api_rows if r["bundle"] == "llm-fused@1.0.0" and r["stratum"].startswith("sm_80"))
    assert want["state"] in cell.text
    world.shot("compat")


def test_ui_files_are_served_with_a_strict_policy(world: World) -> None:
    r = httpx.get(world.ctl.url + "/ui/")
    assert r.status_code == 200 and "text/html" in r.headers["content-type"]
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp and "frame-ancestors 'none'" in csp
    assert httpx.get(world.ctl.url + "/ui/static/app.js").headers["content-type"].startswith("text/javascript")
    for bad in ("../app.py", "..%2Fapp.py", "index.html.bak", "nope.js"):
        assert httpx.get(world.ctl.url + f"/ui/static/{bad}").status_code == 404, bad
    assert httpx.get(world.ctl.url + "/v1/whoami").status_code == 401
    who = world.ctl.client("viewer").get("/v1/whoami").json()
    assert who == {"name": "test-viewer", "role": "viewer", "actor": "viewer:test-viewer"}
