"""The HTTP gateway and the web console: pages and API calls over a deep job table, how soon a log line reaches a
browser, what open follow streams cost the rest of the platform, and the gateway's CPU per request.

    python -m bench.console [--jobs 10000] [--samples 200] [--follow-seconds 30] [--followers 100] [--pairs 3]
                            [--submits 3000] [--in-flight 16] [--agents 1] [--no-browser] [--rounds 1]

Runs the whole local stack as `make up` does (NATS enforcing a login per role, PostgreSQL, the four services,
`--agents` node agents, the platform's default timings) and the gateway (`Stack.start_gateway()`), then:

1. pages and API: `--jobs` jobs submitted as the administrator into a pool no node serves, so that all stay
   queued; then, from one client on this machine (httpx), `--samples` sequential requests of each kind: the jobs
   page (page 1, a deep page, a name search) with a console session's cookie, and `search-jobs` and `list-jobs`
   with a bearer token; p50, p99 and max;
2. log follow: a job on a real agent prints a line with its wall-clock time every 0.5 s on average (at random
   between 0.25 and 0.75 s, so that lines fall at every phase of the polls on their way) for `--follow-seconds`;
   its page (/jobs/<id>) is open in headless Chromium and the lines of its `#logs` are read every 20 ms (each
   line's latency: when it was read, and when it entered the page, less when it was printed), and the same job's
   SSE stream (GET /api/v1/follow/logs) is read beside it, the same lines at the same time; then another such job
   through the SSE endpoint alone, no browser running. Lines printed within a second of a follower's start are
   left out (they come with its first page, not as they are written);
3. followers: `--submits` submissions into the unserved pool (throughput's `submit` workload: 4 clients,
   `--in-flight` requests out each, accepted per second) with no follower, and with `--followers` open SSE
   streams (half on a running job's log, half on its status, from tokens of their own: a token may hold 20);
   `--pairs` pairs taking turns, the order alternating; the medians, their ratio, and whether it is beyond the
   runs' spread;
4. CPU per request: the CPU seconds of each role's processes (bench/cpu.py) over the requests of part 1, per kind.

Without Chromium (`apt-get install chromium chromium-driver`), or with `--no-browser`, or when the gateway serves
no job page, part 2 is measured through the SSE endpoint only, and the report says so. With `--rounds N` the whole
run is repeated N times, each on a fresh stack, and the medians of the rounds' figures are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing
import os
import re
import shutil
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from typing import Any

import httpx
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from bench import cpu
from bench.servers import bench_servers
from bench.throughput import SUBMIT_CLIENTS, cluster_config, percentile, submit_all, trivial_spec
from client.api import TrainyardClient
from devstack.harness import Stack
from libs.auth import issue_token
from libs.contracts.identity import Identity
from libs.contracts.jobspec import AlgorithmRef, JobSpec, OutputRef
from tests.support.browser import CHROMEDRIVER, CHROMIUM, chromium, wait_for

HELD = "held"  # the pool no node serves: its jobs stay queued
PAGE_SIZE = 50  # the jobs page's (services/gateway/console/jobs.py)
DEEP_PAGE = 100
NAME_SEARCHED = "held-123"  # matches held-123 and held-1230 to held-1239
WARM_UP = 5  # requests of each kind before the timed ones: the token's NATS connection is made by the first
SUBMIT_BATCH = 2000
TICK_SECONDS = 0.5
TICK = re.compile(r"tick (\d+) (\d+\.\d+)")
LEAD_SECONDS = 1.0  # lines printed this soon after a follower started come with its first page
DOM_POLL_SECONDS = 0.02
FOLLOWERS_PER_TOKEN = 10  # the gateway holds at most 20 streams per token (services/gateway/follow.py)
PREDICTION_WAIT_SECONDS = 300.0
FOLLOWERS_ALONE_SECONDS = 3.0  # the followers' own cost is looked at this long before each run with them
# The roles whose CPU the report shows per request, in its columns.
SHOWN_ROLES = ("gateway", "scheduler", "postgres", "nats-server", "benchmark client")
RATE_ROLES = ("gateway", "scheduler", "nats-server", "postgres", "benchmark client", "other")

# The page's script appends each log line to #logs as a span; this notes when each entered the page.
OBSERVE_LOGS = """
const logs = document.getElementById("logs");
if (!logs) return false;
window.benchSeen = [];
new MutationObserver((records) => {
  const now = Date.now();
  for (const record of records) for (const node of record.addedNodes) window.benchSeen.push([now, node.textContent]);
}).observe(logs, {childList: true});
return true;
"""
TAKE_SEEN = "const seen = window.benchSeen || []; window.benchSeen = []; return seen;"


@dataclass(frozen=True)
class Plan:
    jobs: int = 10_000
    samples: int = 200
    follow_seconds: float = 30.0
    followers: int = 100
    pairs: int = 3
    submits: int = 3000
    in_flight: int = 16
    agents: int = 1
    browser: bool = True

    @property
    def deep_page(self) -> int:
        return max(1, min(DEEP_PAGE, math.ceil(self.jobs / PAGE_SIZE)))


@dataclass
class Requests:
    """One kind of request of part 1."""

    kind: str  # "page" or "api"
    rows: int  # the jobs an answer holds
    seconds: list[float]
    spent: cpu.Spent


@dataclass
class Follow:
    """Part 2 through one door: each live line's seconds from printed to seen (and, in a browser, to its entry into
    the page)."""

    seen: list[float] = field(default_factory=list)
    entered: list[float] = field(default_factory=list)


@dataclass
class RateRun:
    followers: int
    accepted: int
    seconds: float
    latencies: list[float]
    spent: cpu.Spent
    events: Counter[str] = field(default_factory=Counter)  # what the followers received while open
    alone: cpu.Spent | None = None  # the CPU over FOLLOWERS_ALONE_SECONDS with the followers open, before the run

    @property
    def rate(self) -> float:
        return self.accepted / self.seconds if self.seconds else 0.0


@dataclass
class Figures:
    queued: int = 0
    submit_seconds: float = 0.0
    requests: dict[str, Requests] = field(default_factory=dict)
    follow: dict[str, Follow] = field(default_factory=dict)
    follow_note: str = ""  # why the browser was left out
    runs: list[RateRun] = field(default_factory=list)


Progress = Callable[[str], None]


def ticker_spec(name: str, seconds: float) -> JobSpec:
    """A job that prints `tick <n> <its wall-clock time>` every TICK_SECONDS on average for `seconds`: at random
    between half and one and a half of it, so that its lines fall at every phase of the agent's and the gateway's
    polls (at a steady period the phase, and so the latency, would stay the same all along)."""
    code = (f"import random, time; [(print('tick', i, repr(time.time())), "
            f"time.sleep(random.uniform({TICK_SECONDS / 2}, {TICK_SECONDS * 1.5}))) "
            f"for i in range({int(seconds / TICK_SECONDS)})]")
    # Urgent, as in the runs on record, so that figures stay comparable: before a cycle passed over the jobs no node
    # could take (libs/placement.py `Served`), a normal job behind the unserved pool's 10,000 never started.
    return JobSpec(name=name, flavors=["cpu-1"], algorithm=AlgorithmRef(name="pytorch-ddp"), priority="urgent",
                   command=f'python3 -u -c "{code}"', output=OutputRef(name="ticker"))


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def printed_at(text: str) -> float | None:
    found = TICK.search(text)
    return float(found.group(2)) if found else None


async def signed_in(url: str, token: str) -> httpx.AsyncClient:
    """A client holding a console session's cookie, signed in as the token's user."""
    http = httpx.AsyncClient(base_url=url, timeout=30)
    answer = await http.post("/signin", data={"token": token})
    if answer.status_code != 303 or "trainyard_session" not in http.cookies:
        await http.aclose()
        raise RuntimeError(f"signing in answered {answer.status_code}: {answer.text[:300]}")
    return http


async def predicted(api: TrainyardClient, job_id: str, progress: Progress) -> float:
    """Wait until the job's expected start is planned, as the scheduler does after submissions; the seconds waited."""
    began = time.monotonic()
    while (await api.get_job(job_id)).job.prediction is None:
        if time.monotonic() - began > PREDICTION_WAIT_SECONDS:
            progress(f"  {job_id} still has no prediction after {PREDICTION_WAIT_SECONDS:.0f} s; going on")
            break
        await asyncio.sleep(0.2)
    return time.monotonic() - began


# --- 1. pages and API over a deep table ------------------------------------------------------------------------


async def fill(api: TrainyardClient, clients: Sequence[TrainyardClient], plan: Plan, progress: Progress,
               figures: Figures) -> None:
    progress(f"submitting {plan.jobs} jobs into pool {HELD!r}, which no node serves")
    began = time.monotonic()
    ids: list[str] = []
    for start in range(0, plan.jobs, SUBMIT_BATCH):
        specs = [trivial_spec(i, output=HELD, pool=HELD) for i in range(start, min(plan.jobs, start + SUBMIT_BATCH))]
        ids += (await submit_all(clients, specs, plan.in_flight))[0]
        progress(f"  {len(ids)} accepted, {time.monotonic() - began:.1f} s")
    figures.submit_seconds = time.monotonic() - began
    figures.queued = len(ids)
    waited = await predicted(api, ids[-1], progress)
    progress(f"  the last one's start predicted {waited:.1f} s after its answer")


async def timed(call: Callable[[], Awaitable[httpx.Response]], count: int) -> tuple[list[float], httpx.Response]:
    seconds = []
    answer: httpx.Response | None = None
    for _ in range(count):
        began = time.perf_counter()
        answer = await call()
        seconds.append(time.perf_counter() - began)
        if answer.status_code != 200:
            raise RuntimeError(f"{answer.request.method} {answer.request.url} answered {answer.status_code}: "
                               f"{answer.text[:300]}")
    assert answer is not None
    return seconds, answer


def rows_of(kind: str, answer: httpx.Response) -> int:
    return answer.text.count('data-job="') if kind == "page" else len(answer.json()["jobs"])


async def pages_and_api(url: str, token: str, plan: Plan, cpu_of: Sequence[Path], progress: Progress,
                        figures: Figures) -> None:
    console = await signed_in(url, token)
    api = httpx.AsyncClient(base_url=url, timeout=30, headers=bearer(token))
    kinds: list[tuple[str, str, Callable[[], Awaitable[httpx.Response]]]] = [
        ("GET /jobs", "page", lambda: console.get("/jobs")),
        (f"GET /jobs?page={plan.deep_page}", "page", lambda: console.get("/jobs", params={"page": plan.deep_page})),
        (f"GET /jobs, name {NAME_SEARCHED!r}", "page",
         lambda: console.get("/jobs", params={"field": "name", "value": NAME_SEARCHED})),
        ("POST /api/v1/search-jobs, 50", "api", lambda: api.post("/api/v1/search-jobs", json={"limit": PAGE_SIZE})),
        ("POST /api/v1/list-jobs, 200", "api", lambda: api.post("/api/v1/list-jobs", json={})),
    ]
    try:
        for name, kind, call in kinds:
            await timed(call, WARM_UP)
            before = cpu.look(*cpu_of)
            seconds, answer = await timed(call, plan.samples)
            spent = cpu.spent(before, cpu.look(*cpu_of))
            figures.requests[name] = Requests(kind, rows_of(kind, answer), seconds, spent)
            progress(f"  {name}: p50 {percentile(seconds, 0.5) * 1000:.1f} ms, "
                     f"gateway {spent.by_role.get('gateway', 0.0) / plan.samples * 1000:.1f} ms CPU a request")
    finally:
        await console.aclose()
        await api.aclose()


# --- 2. a log line from the node to the page --------------------------------------------------------------------


def open_browser(url: str, token: str) -> WebDriver:
    driver = chromium()
    try:
        driver.get(f"{url}/signin")
        driver.find_element(By.ID, "token").send_keys(token)
        driver.find_element(By.ID, "signin-submit").click()
        wait_for(driver, lambda d: d.current_url.endswith("/jobs"), what="the jobs page after signing in")
    except BaseException:
        driver.quit()
        raise
    return driver


def read_page(driver: WebDriver, url: str, job_id: str, ticks: int, seconds: float) -> Follow:
    """Open the job's page and read its #logs every DOM_POLL_SECONDS until the last tick shows (or `seconds`)."""
    driver.get(f"{url}/jobs/{job_id}")
    if not driver.execute_script(OBSERVE_LOGS):
        raise RuntimeError(f"the job page has no #logs: {driver.find_element(By.TAG_NAME, 'body').text[:300]}")
    live_from = time.time() + LEAD_SECONDS
    follow = Follow()
    deadline = time.monotonic() + seconds
    last = False
    while not last and time.monotonic() < deadline:
        batch = driver.execute_script(TAKE_SEEN)
        seen = time.time()
        for entered, text in batch:
            found = TICK.search(text)
            if found is None:
                continue
            last = last or int(found.group(1)) == ticks - 1
            printed = float(found.group(2))
            if printed >= live_from:
                follow.seen.append(seen - printed)
                follow.entered.append(entered / 1000 - printed)
        time.sleep(DOM_POLL_SECONDS)
    return follow


async def read_stream(url: str, token: str, job_id: str, seconds: float) -> Follow:
    """Follow the job's log through GET /api/v1/follow/logs until its end (or `seconds`)."""
    follow = Follow()
    async with (httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(30, read=None)) as http,
                asyncio.timeout(seconds),
                http.stream("GET", "/api/v1/follow/logs", params={"job_id": job_id}, headers=bearer(token)) as answer):
        if answer.status_code != 200:
            raise RuntimeError(f"the log stream answered {answer.status_code}: {(await answer.aread())[:300]!r}")
        live_from = time.time() + LEAD_SECONDS
        event = ""
        async for line in answer.aiter_lines():
            seen = time.time()
            if line.startswith("event: "):
                event = line.removeprefix("event: ")
                if event == "end":
                    break
            elif line.startswith("data: ") and event == "error":
                raise RuntimeError(f"the log stream failed: {line}")
            elif line.startswith("data: ") and event == "log":
                for text in json.loads(line.removeprefix("data: "))["lines"]:
                    printed = printed_at(text)
                    if printed is not None and printed >= live_from:
                        follow.seen.append(seen - printed)
    return follow


def browser_missing(plan: Plan) -> str | None:
    if not plan.browser:
        return "--no-browser"
    missing = [path for path in (CHROMIUM, CHROMEDRIVER) if not shutil.which(path)]
    return f"{' and '.join(missing)} missing" if missing else None


async def job_page_missing(url: str, token: str, job_id: str) -> str | None:
    http = await signed_in(url, token)
    try:
        answer = await http.get(f"/jobs/{job_id}")
    finally:
        await http.aclose()
    if answer.status_code != 200 or 'id="logs"' not in answer.text:
        return f"the gateway serves no job page with #logs (GET /jobs/{job_id}: {answer.status_code})"
    return None


async def log_follow(stack: Stack[TrainyardClient], url: str, plan: Plan, progress: Progress,
                     figures: Figures) -> None:
    api = await stack.api()
    window = plan.follow_seconds + 20  # its start, and a margin
    ticks = int((plan.follow_seconds + LEAD_SECONDS * 2) / TICK_SECONDS)
    note = browser_missing(plan)
    if note is None:
        progress("log follow in the browser: starting Chromium and signing in")
        driver = await asyncio.to_thread(open_browser, url, stack.token)
        try:
            job_id = (await api.submit(ticker_spec("ticker-browser", ticks * TICK_SECONDS))).job_id
            await stack.wait_until(job_id, "running", timeout=120)
            note = await job_page_missing(url, stack.token, job_id)
            if note is None:
                progress(f"  {job_id} running; its page open, #logs read every {DOM_POLL_SECONDS * 1000:.0f} ms, "
                         "and its SSE stream read beside it")
                figures.follow["browser"], figures.follow["sse-beside"] = await asyncio.gather(
                    asyncio.to_thread(read_page, driver, url, job_id, ticks, window),
                    read_stream(url, stack.token, job_id, window))
            await stack.wait_until(job_id, "ended", timeout=window)
        finally:
            await asyncio.to_thread(driver.quit)
    if note is not None:
        figures.follow_note = note
        progress(f"  no browser: {note}; through the SSE endpoint only")
    progress("log follow through GET /api/v1/follow/logs")
    job_id = (await api.submit(ticker_spec("ticker-sse", ticks * TICK_SECONDS))).job_id
    await stack.wait_until(job_id, "running", timeout=120)
    figures.follow["sse"] = await read_stream(url, stack.token, job_id, window)
    progress(f"  {len(figures.follow['sse'].seen)} live lines, p50 "
             f"{percentile(figures.follow['sse'].seen, 0.5) * 1000:.0f} ms")


# --- 3. what open followers cost the submissions ----------------------------------------------------------------


async def follower(http: httpx.AsyncClient, path: str, job_id: str, token: str, opened: asyncio.Future[int],
                   events: Counter[str]) -> None:
    try:
        async with http.stream("GET", path, params={"job_id": job_id}, headers=bearer(token)) as answer:
            opened.set_result(answer.status_code)
            if answer.status_code != 200:
                return
            async for line in answer.aiter_lines():
                if line.startswith("event: "):
                    events[line.removeprefix("event: ")] += 1
    except Exception as exc:
        if not opened.done():
            opened.set_exception(exc)
        raise


async def hold_streams(url: str, tokens: Sequence[str], job_id: str, count: int, told: Connection,
                       stop: EventType) -> None:
    """`count` open streams, half on the job's log and half on its status, FOLLOWERS_PER_TOKEN on each token; told
    "open" once all are, then, once `stop` is set, the events they received (or "failed" and why)."""
    events: Counter[str] = Counter()
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(30, read=None), limits=limits) as http:
        loop = asyncio.get_running_loop()
        opened: list[asyncio.Future[int]] = [loop.create_future() for _ in range(count)]
        tasks = [asyncio.create_task(follower(http, "/api/v1/follow/logs" if n % 2 == 0 else "/api/v1/follow/status",
                                              job_id, tokens[n // FOLLOWERS_PER_TOKEN], opened[n], events))
                 for n in range(count)]
        try:
            statuses = await asyncio.wait_for(asyncio.gather(*opened), timeout=60)
            refused = Counter(status for status in statuses if status != 200)
            if refused:
                raise RuntimeError(f"{sum(refused.values())} of {count} streams were refused: {dict(refused)}")
            told.send(("open", ""))
            while not stop.is_set():
                await asyncio.sleep(0.05)
            told.send(("events", dict(events)))
        except Exception as exc:
            told.send(("failed", repr(exc)))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def streams_process(url: str, tokens: list[str], job_id: str, count: int, told: Connection, stop: EventType) -> None:
    asyncio.run(hold_streams(url, tokens, job_id, count, told, stop))


@contextlib.asynccontextmanager
async def followers(url: str, secret: str, job_id: str, count: int, events: Counter[str]) -> AsyncIterator[None]:
    """`count` followers of the job, open while the block runs, from a process of their own: their reading does not
    hold up the submissions' event loop (its CPU is counted as "other"); `events` what they received meanwhile."""
    tokens = [issue_token(secret, Identity(user=f"follower-{n}", projects=["default"], admin=True))
              for n in range(math.ceil(count / FOLLOWERS_PER_TOKEN))]
    spawning = multiprocessing.get_context("spawn")
    told, telling = spawning.Pipe(duplex=False)
    stop = spawning.Event()
    process = spawning.Process(target=streams_process, args=(url, tokens, job_id, count, telling, stop), daemon=True)
    process.start()
    telling.close()  # the child's end only: a child that dies ends the pipe

    async def heard(expected: str, seconds: float) -> Any:
        if not await asyncio.to_thread(told.poll, seconds):
            raise RuntimeError(f"the followers said nothing for {seconds:.0f} s")
        try:
            what, detail = told.recv()
        except EOFError:
            raise RuntimeError(f"the followers' process ended (exit code {process.exitcode})") from None
        if what != expected:
            raise RuntimeError(f"the followers failed: {detail}")
        return detail

    try:
        await heard("open", 120)
        yield
        stop.set()
        events.update(await heard("events", 60))
    finally:
        stop.set()
        await asyncio.to_thread(process.join, 30)
        if process.is_alive():
            process.kill()


async def submissions(api: TrainyardClient, clients: Sequence[TrainyardClient], plan: Plan, turn: int,
                      count: int, cpu_of: Sequence[Path]) -> RateRun:
    specs = [trivial_spec(f"{turn}-{i}", output="rate", pool=HELD) for i in range(plan.submits)]
    before = cpu.look(*cpu_of)
    ids, latencies, began, answered = await submit_all(clients, specs, plan.in_flight)
    run = RateRun(count, len(ids), answered - began, latencies, cpu.spent(before, cpu.look(*cpu_of)))
    await predicted(api, ids[-1], lambda line: None)  # the scheduler quiet again before the next run
    return run


async def follow_cost(stack: Stack[TrainyardClient], url: str, clients: Sequence[TrainyardClient], plan: Plan,
                      cpu_of: Sequence[Path], progress: Progress, figures: Figures) -> None:
    api = await stack.api()
    secret = (stack.home / "auth-secret").read_text().strip()
    job_id = (await api.submit(ticker_spec("ticker-followed", 3600))).job_id
    await stack.wait_until(job_id, "running", timeout=120)
    progress(f"submissions with 0 and {plan.followers} followers of {job_id}, {plan.pairs} pairs taking turns")
    try:
        for turn in range(plan.pairs * 2):
            count = plan.followers if (turn % 2 == 0) == (turn // 2 % 2 == 1) else 0  # 0, N; N, 0; 0, N; ...
            if count:
                events: Counter[str] = Counter()
                async with followers(url, secret, job_id, count, events):
                    await asyncio.sleep(1)  # every stream past its first page
                    before = cpu.look(*cpu_of)
                    await asyncio.sleep(FOLLOWERS_ALONE_SECONDS)
                    alone = cpu.spent(before, cpu.look(*cpu_of))
                    run = await submissions(api, clients, plan, turn, count, cpu_of)
                run.events, run.alone = events, alone
            else:
                run = await submissions(api, clients, plan, turn, count, cpu_of)
            figures.runs.append(run)
            progress(f"  run {turn + 1}: {count} followers, {run.rate:.0f} submissions/s, gateway "
                     f"{run.spent.by_role.get('gateway', 0.0) / run.seconds:.2f} CPU s/s, followers received "
                     f"{sum(run.events.values())} events")
    finally:
        await api.stop([job_id])


# --- the run -------------------------------------------------------------------------------------------------------


async def measure(stack: Stack[TrainyardClient], plan: Plan, progress: Progress,
                  cpu_of: Sequence[Path] = ()) -> Figures:
    """Every part on a stack not yet started; `cpu_of`: the run's folders (bench/cpu.py), beside this process's
    own children."""
    figures = Figures()
    clients: list[TrainyardClient] = []
    try:
        progress(f"starting the stack with {len(stack.nodes)} agent(s) and the gateway")
        api = await stack.up()
        url = await stack.start_gateway()
        # One user submits every job, far faster and more of them than a person's limits allow.
        await api.change_settings(max_queued_jobs_per_user=0, submit_rate=0)
        clients = [await TrainyardClient.open(stack.nats_url, token=stack.token) for _ in range(SUBMIT_CLIENTS)]
        await fill(api, clients, plan, progress, figures)
        progress(f"pages and API: {plan.samples} sequential requests of each kind")
        await pages_and_api(url, stack.token, plan, cpu_of, progress, figures)
        await log_follow(stack, url, plan, progress, figures)
        await follow_cost(stack, url, clients, plan, cpu_of, progress, figures)
    finally:
        for client in clients:
            await client.close()
    return figures


async def fresh_round(plan: Plan, home: Path, progress: Progress) -> Figures:
    async with bench_servers("console") as servers:
        stack = Stack(home / "stack", None, servers.database_url, connect=TrainyardClient.open,
                      cluster=cluster_config(home / "cluster.yaml", plan.agents), timings={})
        try:
            return await measure(stack, plan, progress, (home, servers.home))
        finally:
            await stack.close()


# --- the report ------------------------------------------------------------------------------------------------


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}" if seconds < 0.1 else f"{seconds * 1000:.0f}"


def per_request(spent: cpu.Spent, role: str, count: int) -> float:
    return spent.by_role.get(role, 0.0) / count * 1000


def requests_table(figures: Figures, plan: Plan) -> list[str]:
    lines = [f"Pages and API with {figures.queued:,} jobs queued: {plan.samples} sequential requests of each kind, "
             "one client on this machine (ms; then the CPU of each role in ms a request: the run's own processes "
             "all told, and the machine's busy CPU, others' work included)",
             f"{'request':<34} {'rows':>4} {'p50':>6} {'p99':>6} {'max':>6} {'gateway':>8} {'scheduler':>9} "
             f"{'postgres':>8} {'nats':>5} {'client':>6} {'ours':>6} {'busy':>6}"]
    for name, timed_ in figures.requests.items():
        count = len(timed_.seconds)
        lines.append(f"{name:<34} {timed_.rows:>4} {ms(percentile(timed_.seconds, 0.5)):>6} "
                     f"{ms(percentile(timed_.seconds, 0.99)):>6} {ms(max(timed_.seconds)):>6} "
                     + " ".join(f"{per_request(timed_.spent, role, count):>{width}.2f}"
                                for role, width in zip(SHOWN_ROLES, (8, 9, 8, 5, 6), strict=True))
                     + f" {sum(timed_.spent.by_role.values()) / count * 1000:>6.2f}"
                     + f" {timed_.spent.busy / count * 1000:>6.2f}")
    for kind, label in (("page", "pages"), ("api", "API calls")):
        chosen = [timed_ for timed_ in figures.requests.values() if timed_.kind == kind]
        if chosen:
            count = sum(len(timed_.seconds) for timed_ in chosen)
            gateway = sum(timed_.spent.by_role.get("gateway", 0.0) for timed_ in chosen)
            lines.append(f"the gateway's CPU per request, {label}: {gateway / count * 1000:.2f} ms "
                         f"({gateway:.2f} CPU s over {count} requests)")
    return lines


def follow_table(figures: Figures, plan: Plan) -> list[str]:
    lines = [f"Log follow: a line printed on the node (every {TICK_SECONDS} s on average for "
             f"{plan.follow_seconds:.0f} s) until seen, ms",
             f"{'through':<46} {'lines':>5} {'p50':>6} {'p99':>6} {'max':>6}"]
    rows: list[tuple[str, list[float]]] = []
    if "browser" in figures.follow:
        rows += [(f"Chromium, #logs read every {DOM_POLL_SECONDS * 1000:.0f} ms", figures.follow["browser"].seen),
                 ("Chromium, the line's entry into #logs", figures.follow["browser"].entered)]
    if "sse-beside" in figures.follow:
        rows.append(("the same job's SSE stream, read beside it", figures.follow["sse-beside"].seen))
    if "sse" in figures.follow:
        rows.append(("GET /api/v1/follow/logs alone (httpx)", figures.follow["sse"].seen))
    for name, seconds in rows:
        if seconds:
            lines.append(f"{name:<46} {len(seconds):>5} {ms(percentile(seconds, 0.5)):>6} "
                         f"{ms(percentile(seconds, 0.99)):>6} {ms(max(seconds)):>6}")
        else:
            lines.append(f"{name:<46} {0:>5} (no line seen)")
    if figures.follow_note:
        lines.append(f"(no browser: {figures.follow_note})")
    return lines


def spread_verdict(without: Sequence[float], with_: Sequence[float]) -> str:
    if len(without) < 2 or len(with_) < 2:
        return "one run a side has no spread to weigh the difference against"
    if max(with_) < min(without) or min(with_) > max(without):
        return "beyond the runs' spread (the two ranges do not overlap)"
    return "within the runs' spread (the two ranges overlap)"


def rates_table(figures: Figures, plan: Plan) -> list[str]:
    lines = [f"Submissions ({plan.submits} a run, {SUBMIT_CLIENTS} clients x {plan.in_flight} in flight, into a pool "
             f"no node serves) with and without {plan.followers} SSE followers (events: what the followers received "
             "while open; then CPU seconds a second of each role, the followers' own process as 'other', the run's "
             "own processes all told, and the machine's busy CPU, others' work included)",
             f"{'run':>3} {'followers':>9} {'accepted/s':>10} {'p50 ms':>7} {'p99 ms':>7} {'events':>7} "
             + " ".join(f"{role:>{max(len(role), 5)}}" for role in RATE_ROLES) + f" {'ours':>5} {'busy':>5}"]
    for turn, run in enumerate(figures.runs, 1):
        lines.append(f"{turn:>3} {run.followers:>9} {run.rate:>10.0f} {ms(percentile(run.latencies, 0.5)):>7} "
                     f"{ms(percentile(run.latencies, 0.99)):>7} {sum(run.events.values()):>7} "
                     + " ".join(f"{run.spent.by_role.get(role, 0.0) / run.seconds:>{max(len(role), 5)}.2f}"
                                for role in RATE_ROLES)
                     + f" {sum(run.spent.by_role.values()) / run.seconds:>5.2f} {run.spent.busy / run.seconds:>5.2f}")
    without = [run.rate for run in figures.runs if not run.followers]
    with_ = [run.rate for run in figures.runs if run.followers]
    if without and with_:
        ratios = [on.rate / off.rate for off, on in pairs_of(figures.runs)]
        lines.append(f"median {statistics.median(without):.0f}/s without, {statistics.median(with_):.0f}/s with "
                     f"{plan.followers} followers: ratio {statistics.median(with_) / statistics.median(without):.2f} "
                     f"(by pair {', '.join(f'{r:.2f}' for r in ratios)}); {spread_verdict(without, with_)}")
    alone = [run.alone for run in figures.runs if run.alone is not None]
    if alone:
        cores = os.cpu_count() or 1  # `total` counts every core's seconds
        shares = {role: statistics.median(spent.by_role.get(role, 0.0) / spent.total * cores for spent in alone)
                  for role in RATE_ROLES}
        lines.append(f"{plan.followers} followers alone, no submission ({FOLLOWERS_ALONE_SECONDS:.0f} s before each "
                     "run with them; medians), CPU s/s: " + ", ".join(f"{role} {share:.3f}"
                                                                      for role, share in shares.items()))
    return lines


def pairs_of(runs: Sequence[RateRun]) -> list[tuple[RateRun, RateRun]]:
    """Each pair's run without followers and its run with them."""
    found = []
    for first, second in zip(runs[::2], runs[1::2], strict=False):
        found.append((first, second) if not first.followers else (second, first))
    return found


def report(figures: Figures, plan: Plan) -> list[str]:
    return [f"{figures.queued:,} jobs submitted in {figures.submit_seconds:.1f} s", "",
            *requests_table(figures, plan), "", *follow_table(figures, plan), "", *rates_table(figures, plan)]


def summary(rounds: Sequence[Figures]) -> list[str]:
    """The medians of the rounds' figures."""
    lines = [f"Medians of {len(rounds)} rounds"]
    for name in rounds[0].requests:
        p50s = [percentile(figures.requests[name].seconds, 0.5) for figures in rounds]
        lines.append(f"  {name}: p50 {ms(statistics.median(p50s))} ms (rounds {', '.join(ms(p) for p in p50s)})")
    for door in rounds[0].follow:
        p50s = [percentile(figures.follow[door].seen, 0.5) for figures in rounds
                if door in figures.follow and figures.follow[door].seen]
        if p50s:
            lines.append(f"  log follow, {door}: p50 {ms(statistics.median(p50s))} ms")
    ratios = []
    for figures in rounds:
        without = [run.rate for run in figures.runs if not run.followers]
        with_ = [run.rate for run in figures.runs if run.followers]
        if without and with_:
            ratios.append(statistics.median(with_) / statistics.median(without))
    if ratios:
        lines.append(f"  submissions with followers / without: {statistics.median(ratios):.2f} "
                     f"(rounds {', '.join(f'{r:.2f}' for r in ratios)})")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=Plan.jobs, help="jobs queued while pages and API are timed")
    parser.add_argument("--samples", type=int, default=Plan.samples, help="requests of each kind")
    parser.add_argument("--follow-seconds", type=float, default=Plan.follow_seconds,
                        help="how long each followed job prints its lines")
    parser.add_argument("--followers", type=int, default=Plan.followers)
    parser.add_argument("--pairs", type=int, default=Plan.pairs, help="pairs of submission runs without and with")
    parser.add_argument("--submits", type=int, default=Plan.submits, help="submissions a run")
    parser.add_argument("--in-flight", type=int, default=Plan.in_flight)
    parser.add_argument("--agents", type=int, default=Plan.agents)
    parser.add_argument("--no-browser", action="store_true", help="follow the log through the SSE endpoint only")
    parser.add_argument("--rounds", type=int, default=1, help="the whole run this many times, each on a fresh stack")
    args = parser.parse_args()
    plan = Plan(jobs=args.jobs, samples=args.samples, follow_seconds=args.follow_seconds, followers=args.followers,
                pairs=args.pairs, submits=args.submits, in_flight=args.in_flight, agents=args.agents,
                browser=not args.no_browser)

    def progress(line: str) -> None:
        print(line, flush=True)

    began = time.monotonic()
    rounds: list[Figures] = []
    with tempfile.TemporaryDirectory(prefix="trainyard-console-") as workdir:
        top = Path(workdir)
        top.chmod(0o755)
        for turn in range(1, args.rounds + 1):
            if args.rounds > 1:
                progress(f"round {turn} of {args.rounds}")
            home = top / f"round-{turn}"
            home.mkdir(mode=0o755)
            rounds.append(asyncio.run(fresh_round(plan, home, progress)))
    for turn, figures in enumerate(rounds, 1):
        print()
        if args.rounds > 1:
            print(f"round {turn}")
        print("\n".join(report(figures, plan)))
    if len(rounds) > 1:
        print()
        print("\n".join(summary(rounds)))
    print(f"\n(the run took {(time.monotonic() - began) / 60:.1f} min)")


if __name__ == "__main__":
    main()
