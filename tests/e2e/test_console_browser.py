"""The console in a real browser (Debian's Chromium, through Selenium) against the whole stack: real services,
agents and jobs, the gateway started as `make up` starts it. Each flow is done as a person does it, by clicking
and typing, and checked by what the page then shows."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio
from selenium.webdriver.common.action_chains import ActionChains
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import Select

from libs.auth import issue_token
from libs.contracts.identity import Identity
from libs.contracts.jobspec import AlgorithmRef, DebugTerminal, JobSpec, OutputRef
from tests.support.browser import driven, screenshot, wait_for
from tests.support.specs import sleeper
from tests.support.stack import Stack


@pytest.fixture
def browser() -> Iterator[WebDriver]:
    yield from driven()


@pytest_asyncio.fixture(loop_scope="session")
async def console(stack: Stack) -> AsyncIterator[str]:
    """The stack up, with its gateway; the console's base URL."""
    await stack.up()
    yield await stack.start_gateway()


def user_token(stack: Stack, user: str, *projects: str) -> str:
    secret = (stack.home / "auth-secret").read_text().strip()
    return issue_token(secret, Identity(user=user, projects=list(projects or ["default"])))


def sign_in(driver: WebDriver, url: str, token: str) -> None:
    driver.get(f"{url}/signin")
    driver.find_element(By.ID, "token").send_keys(token)
    driver.find_element(By.ID, "signin-submit").click()
    wait_for(driver, lambda d: d.current_url.endswith("/jobs"), what="the jobs page after signing in")


def row(driver: WebDriver, job_id: str) -> object:
    return driver.find_element(By.CSS_SELECTOR, f'tr[data-job="{job_id}"]')


async def test_stop_batch_delete_and_an_action_hidden_from_a_read_only_colleague(
        stack: Stack, console: str, browser: WebDriver, tmp_path: Path) -> None:
    api = await stack.api()
    running = (await api.submit(sleeper("long-run", seconds=300))).job_id
    await stack.wait_until(running, "running")
    done = [(await api.submit(sleeper(f"short-{n}", seconds=0.1))).job_id for n in range(2)]
    for job_id in done:
        await stack.wait_until(job_id, "ended")

    await asyncio.to_thread(sign_in, browser, console, stack.token)
    screenshot(browser, "jobs", tmp_path)
    menu = row(browser, running).find_element(By.CSS_SELECTOR, "details.menu")  # type: ignore[attr-defined]
    menu.find_element(By.TAG_NAME, "summary").click()
    menu.find_element(By.LINK_TEXT, "Stop").click()
    screenshot(browser, "stop-dialog", tmp_path)
    browser.find_element(By.ID, "confirm").click()
    wait_for(browser, lambda d: d.find_elements(By.ID, "notice"), what="the notice that the job is stopping")
    job = await stack.wait_until(running, "ended")
    assert job.status == "stopped"

    browser.get(f"{console}/jobs")
    for job_id in done:
        row(browser, job_id).find_element(By.NAME, "job_id").click()  # type: ignore[attr-defined]
    browser.find_element(By.ID, "delete-selected").click()
    wait_for(browser, lambda d: d.find_elements(By.ID, "confirm-delete"), what="the confirmation of the delete")
    browser.find_element(By.ID, "confirm").click()
    wait_for(browser, lambda d: d.find_elements(By.ID, "notice"), what="the notice that they are deleted")
    for job_id in done:
        assert not browser.find_elements(By.CSS_SELECTOR, f'tr[data-job="{job_id}"]')
    assert not {job.job_id for job in await api.search(name="short-")} & set(done)

    # A colleague of the project who may only read: no stop offered, and forcing it is refused.
    shared = (await api.submit(msgspec.structs.replace(sleeper("shared", seconds=300), access="read-only"))).job_id
    await stack.wait_until(shared, "running")
    browser.delete_all_cookies()
    await asyncio.to_thread(sign_in, browser, console, user_token(stack, "viewer"))
    menu = row(browser, shared).find_element(By.CSS_SELECTOR, "details.menu")  # type: ignore[attr-defined]
    menu.find_element(By.TAG_NAME, "summary").click()
    offered = [item.text for item in menu.find_elements(By.CSS_SELECTOR, "li a")]
    assert "Clone" in offered and "Stop" not in offered, offered
    browser.get(f"{console}/jobs/{shared}/stop")
    browser.find_element(By.ID, "confirm").click()
    refusal = wait_for(browser, lambda d: d.find_elements(By.ID, "refusal"), what="the refusal")
    assert refusal[0].text
    screenshot(browser, "refused", tmp_path)
    assert (await api.get_job(shared)).job.status == "running"


def choose(driver: WebDriver, element_id: str, value: str) -> None:
    Select(driver.find_element(By.ID, element_id)).select_by_value(value)


def retype(driver: WebDriver, element_id: str, text: str) -> None:
    field = driver.find_element(By.ID, element_id)
    field.clear()
    field.send_keys(text)


def prediction_of(driver: WebDriver) -> str:
    return str(driver.find_element(By.ID, "prediction").get_attribute("data-starts-now") or "")


async def test_create_a_two_node_job_from_the_form_and_watch_it_succeed(
        stack: Stack, console: str, browser: WebDriver, tmp_path: Path) -> None:
    await asyncio.to_thread(sign_in, browser, console, stack.token)
    browser.get(f"{console}/jobs/new")
    retype(browser, "name", "from-the-form")
    choose(browser, "mode", "pytorch")
    retype(browser, "nodes", "2")
    browser.find_element(By.CSS_SELECTOR, 'input[name="flavors"][value="cpu-1"]').click()
    retype(browser, "algorithm-name", "sleeper")
    retype(browser, "output", "from-the-form")
    retype(browser, "command", 'bash -c "for i in 1 2 3; do echo step $i; sleep 0.3; done"')
    wait_for(browser, lambda d: prediction_of(d) == "true", what="the prediction that 2 nodes start now")

    # Two nodes of cpu-1 exist: asking for 5 cannot start now, and the prediction beside Create says so.
    retype(browser, "nodes", "5")
    wait_for(browser, lambda d: prediction_of(d) == "false", what="the prediction that 5 nodes must wait")
    retype(browser, "nodes", "2")
    wait_for(browser, lambda d: prediction_of(d) == "true", what="the prediction back to starting now")

    browser.find_element(By.ID, "show-resources").click()
    table = wait_for(browser, lambda d: [t for t in d.find_elements(By.ID, "resources") if "node-a" in t.text],
                     what="the cluster's available resources")
    assert "node-b" in table[0].text
    screenshot(browser, "create", tmp_path)

    browser.find_element(By.ID, "create-submit").click()
    wait_for(browser, lambda d: "/jobs/job-" in d.current_url, what="the new job's page")
    job_id = browser.current_url.rstrip("/").rsplit("/", 1)[1]
    wait_for(browser, lambda d: d.find_element(By.ID, "job-status").get_attribute("data-status") == "succeeded",
             seconds=90, what="the job to succeed on its page")
    logs = wait_for(browser, lambda d: [e for e in d.find_elements(By.ID, "logs") if "step 3" in e.text],
                    what="both ranks' logs on the page")
    assert "[0]" in logs[0].text and "[1]" in logs[0].text
    screenshot(browser, "job", tmp_path)
    job = (await (await stack.api()).get_job(job_id)).job
    assert (job.name, job.nodes, job.status) == ("from-the-form", 2, "succeeded")

    # Clone it: the form comes back filled from the job, and creating it makes a second job.
    browser.get(f"{console}/jobs")
    menu = row(browser, job_id).find_element(By.CSS_SELECTOR, "details.menu")  # type: ignore[attr-defined]
    menu.find_element(By.TAG_NAME, "summary").click()
    menu.find_element(By.LINK_TEXT, "Clone").click()
    wait_for(browser, lambda d: d.find_element(By.ID, "name").get_attribute("value") == "from-the-form-clone",
             what="the clone's form, filled")
    assert browser.find_element(By.ID, "nodes").get_attribute("value") == "2"
    browser.find_element(By.ID, "create-submit").click()
    wait_for(browser, lambda d: "/jobs/job-" in d.current_url and job_id not in d.current_url, what="the clone's page")
    clone_id = browser.current_url.rstrip("/").rsplit("/", 1)[1]
    assert (await (await stack.api()).get_job(clone_id)).job.cloned_from == job_id


async def test_the_terminal_of_a_kept_failed_job_runs_a_command(
        stack: Stack, console: str, browser: WebDriver, tmp_path: Path) -> None:
    api = await stack.api()
    spec = JobSpec(name="debug-me", flavors=["cpu-1"], algorithm=AlgorithmRef(name="sleeper"),
                   output=OutputRef(name="debug-me"), command="python3 run.py --seconds 0.2 --exit-code 4",
                   debug_terminal=DebugTerminal(enabled=True))
    job_id = (await api.submit(spec)).job_id
    assert (await stack.wait_until(job_id, "ended")).status == "failed"
    async with asyncio.timeout(120):
        while (await api.get_job(job_id)).job.kept_until is None:
            await asyncio.sleep(0.2)

    await asyncio.to_thread(sign_in, browser, console, stack.token)
    browser.get(f"{console}/jobs/{job_id}")
    wait_for(browser, lambda d: d.find_elements(By.ID, "open-terminal"), what="the terminal's button")
    browser.find_element(By.ID, "open-terminal").click()
    terminal = wait_for(browser, lambda d: d.find_elements(By.CSS_SELECTOR, "#terminal .xterm"),
                        what="the terminal drawn")[0]
    terminal.click()
    ActionChains(browser).send_keys('echo "kept $TRAINYARD_JOB_ID"\n').perform()
    wait_for(browser, lambda d: f"kept {job_id}" in d.find_element(By.ID, "terminal").text,
             what="the command's output in the terminal")
    screenshot(browser, "terminal", tmp_path)


async def test_the_console_in_chinese_and_the_cluster_pages(stack: Stack, console: str, tmp_path: Path) -> None:
    """A browser whose language is Chinese gets the seed's own terms; the cluster pages show the nodes, the
    alerts and, for an administrator, the settings."""
    api = await stack.api()
    waiting = msgspec.structs.replace(sleeper("waits", nodes=2, seconds=300), nodes=9, name="排队的任务")
    await api.submit(waiting)  # 9 nodes: it queues for good
    for driver in driven("zh-CN"):
        await asyncio.to_thread(sign_in, driver, console, stack.token)
        page = driver.find_element(By.TAG_NAME, "body").text
        assert "任务式训练" in page and "排队中" in page and "操作" in page, page[:500]
        screenshot(driver, "jobs-zh", tmp_path)
        driver.get(f"{console}/jobs/new")
        wait_for(driver, lambda d: d.find_element(By.ID, "prediction").get_attribute("data-starts-now") is not None,
                 what="the form ready")
        assert "集群可用资源" in driver.find_element(By.TAG_NAME, "body").text
        screenshot(driver, "create-zh", tmp_path)
        for path, name, shown in (("/cluster", "cluster", "node-a"), ("/cluster/alerts", "alerts", ""),
                                  ("/cluster/autoscaler", "autoscaler", ""), ("/cluster/admin", "admin", "")):
            driver.get(f"{console}{path}")
            assert shown in driver.find_element(By.TAG_NAME, "body").text
            assert not driver.find_elements(By.ID, "refusal"), path
            screenshot(driver, name, tmp_path)
        driver.get(f"{console}/language/en?next=/cluster")
        assert "Nodes" in driver.find_element(By.TAG_NAME, "body").text
