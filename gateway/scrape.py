"""``/metrics``: :mod:`gateway.metrics`'s families in the Prometheus exposition format.

**One process** (``gateway serve``): a prometheus-client collector reads the live counts at
each scrape, on the event loop's thread, so a scrape sees every count up to that instant.

**Several** (``gateway serve --workers N``): uvicorn's workers are separate processes and a
scrape reaches one of them, so this uses prometheus-client's multiprocess mode. Each worker
writes its samples (every :data:`FLUSH_INTERVAL` seconds, and before it answers a scrape)
to files of its own in the directory ``PROMETHEUS_MULTIPROC_DIR`` names (``gateway serve``
makes it), and a scrape merges every worker's files: counters and histograms summed, each
gauge as its family's ``aggregate`` says. So one target shows the whole instance, and the
counts of a worker that died stay in the totals.

``GATEWAY_METRICS_PORT`` moves ``/metrics`` off the main port onto one of its own (the main
port then answers 404), served by prometheus-client's HTTP server on a thread: of the
gateway's process, or with ``--workers``, of the ``gateway serve`` process that supervises
them.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.utils import floatToGoString
from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from .metrics import Family, Sampled, families
from .redis.counters import Histogram

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from .runtime import Gateway

log = logging.getLogger("gateway.metrics")

MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"
FLUSH_INTERVAL = 2.0  # seconds between writes of a worker's samples (--workers)
# Counting asyncio tasks walks all of them (some 100 ms for 100,000 connections): a
# scrape counts them afresh, a write between scrapes takes a count at most this old.
TASKS_MAX_AGE = 15.0


def multiprocess_dir() -> str | None:
    """The shared directory of multiprocess mode, or None for one process."""
    return os.environ.get(MULTIPROCESS_ENV) or None


# --- families as prometheus-client metrics ---------------------------------------------------


def _buckets(hist: Histogram) -> list[tuple[str, float]]:
    bounds = [*hist.bounds, float("inf")]
    return [(floatToGoString(b), n) for b, n in zip(bounds, hist.cumulative(), strict=True)]


def to_metrics(found: list[Family]) -> Iterator[Metric]:
    for family in found:
        metric: Any
        if family.kind == "histogram":
            metric = HistogramMetricFamily(family.name, family.help, labels=family.labels)
            for labels, hist in family.samples:
                metric.add_metric(list(labels), _buckets(hist), hist.sum)
        else:
            kind = CounterMetricFamily if family.kind == "counter" else GaugeMetricFamily
            metric = kind(family.name, family.help, labels=family.labels)
            for labels, value in family.samples:
                metric.add_metric(list(labels), value)
        yield metric


class _LiveCollector:
    """The collector of one process: the families, read on the event loop's thread."""

    def __init__(self, exporter: Exporter) -> None:
        self._exporter = exporter

    def collect(self) -> Iterator[Metric]:
        return to_metrics(self._exporter.read())


# --- multiprocess mode -----------------------------------------------------------------------


class FileWriter:
    """This process's samples in multiprocess mode's files (``<kind>_<pid>.db``, a gauge's
    ``gauge_<aggregate>_<pid>.db``): what :class:`MultiProcessCollector` merges."""

    def __init__(self, directory: str, pid: int) -> None:
        self._directory = directory
        self._pid = pid
        self._files: dict[str, MmapedDict] = {}
        self._keys: dict[tuple[str, tuple[str, ...]], str] = {}
        self._written: dict[str, float] = {}  # key -> the value last written

    def write(self, found: list[Family]) -> None:
        now = time.time()
        for family in found:
            if family.kind == "gauge":
                file = self._file(f"gauge_{family.aggregate}")
                stamp = now if family.aggregate.endswith("mostrecent") else 0.0
                for labels, value in family.samples:
                    self._put(file, family, family.name, family.labels, labels, value, stamp)
            elif family.kind == "counter":
                file = self._file("counter")
                for labels, value in family.samples:
                    self._put(file, family, family.name + "_total", family.labels, labels,
                              value)
            else:
                file = self._file("histogram")
                names = (*family.labels, "le")
                for labels, hist in family.samples:
                    bounds = [*hist.bounds, float("inf")]
                    for bound, count in zip(bounds, hist.counts, strict=True):  # not cumulative
                        self._put(file, family, family.name + "_bucket", names,
                                  (*labels, floatToGoString(bound)), count)
                    self._put(file, family, family.name + "_sum", family.labels, labels,
                              hist.sum)

    def _file(self, prefix: str) -> MmapedDict:
        file = self._files.get(prefix)
        if file is None:
            path = os.path.join(self._directory, f"{prefix}_{self._pid}.db")
            file = self._files[prefix] = MmapedDict(path)
        return file

    def _put(self, file: MmapedDict, family: Family, name: str, labelnames: tuple[str, ...],
             labels: tuple[str, ...], value: float, stamp: float = 0.0) -> None:
        key = self._keys.get((name, labels))
        if key is None:
            key = self._keys[name, labels] = mmap_key(family.name, name, list(labelnames),
                                                      list(labels), family.help)
        if stamp or self._written.get(key) != value:
            file.write_value(key, float(value), stamp)
            self._written[key] = value

    def close(self) -> None:
        for file in self._files.values():
            file.close()
        self._files.clear()


def multiprocess_registry(directory: str) -> CollectorRegistry:
    """Every worker's samples in ``directory``, merged at each scrape."""
    registry = CollectorRegistry(auto_describe=False)
    MultiProcessCollector(registry, directory)
    return registry


def forget_dead_workers(directory: str) -> None:
    """Drop the gauges of workers that are gone (one that died was replaced); their
    counters stay, so totals never go back."""
    for path in glob.glob(os.path.join(directory, "gauge_live*_*.db")):
        pid = int(Path(path).stem.rsplit("_", 1)[1])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            mark_process_dead(pid, directory)
        except PermissionError:
            pass  # alive, someone else's


def prepare_multiprocess_dir() -> str | None:
    """For ``gateway serve --workers N``: the directory the workers share, empty, in the
    environment they inherit. Returns it when made here (to delete at exit)."""
    given = multiprocess_dir()
    if given is not None:
        os.makedirs(given, exist_ok=True)
        for path in glob.glob(os.path.join(given, "*.db")):  # a previous run's
            os.remove(path)
        return None
    made = tempfile.mkdtemp(prefix="gateway-metrics-")
    os.environ[MULTIPROCESS_ENV] = made
    return made


def remove_multiprocess_dir(made: str | None) -> None:
    if made is not None:
        shutil.rmtree(made, ignore_errors=True)


# --- serving ---------------------------------------------------------------------------------


class MetricsPort:
    """``/metrics`` on a port of its own, served by a thread."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry) -> None:
        server: WSGIServer
        server, self._thread = start_http_server(port, host, registry)
        self._server = server

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


async def sample(gateway: Gateway, sampled: Sampled) -> None:
    """Refresh ``sampled`` from the runtime: readiness as ``/readyz`` reports it, the
    agent inbox's consumer groups and its running turns."""
    report = await gateway.backend.health()
    report["pubsub"] = "ok" if gateway.hub.connected else "reconnecting"
    sampled.ready = {name: state == "ok" for name, state in report.items()}
    inbox = gateway.conversations.inbox
    try:
        sampled.groups, sampled.running = await asyncio.gather(inbox.groups(), inbox.running())
    except (RedisError, OSError) as exc:
        log.debug("sampling the agent inbox for /metrics: %s", exc)  # readiness tells


class Exporter:
    """This process's ``/metrics``: a companion of its :class:`~gateway.runtime.Gateway`
    (started after it), answering on the main port's route or on the metrics port."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.sampled = Sampled()
        self.directory = multiprocess_dir()
        self._writer: FileWriter | None = None
        if self.directory is not None:
            self.registry = multiprocess_registry(self.directory)
        else:
            self.registry = CollectorRegistry(auto_describe=False)
            self.registry.register(_LiveCollector(self))
            ProcessCollector(registry=self.registry)  # CPU, memory, open fds
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._flusher: asyncio.Task[None] | None = None
        self._port: MetricsPort | None = None
        self._tasks, self._tasks_at = 0, -TASKS_MAX_AGE

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        port = self.gateway.settings.metrics_port
        if self.directory is not None:
            forget_dead_workers(self.directory)
            self._writer = FileWriter(self.directory, os.getpid())
            await self._write(fresh=True)
            self._flusher = asyncio.create_task(self._flush_loop(), name="metrics-flush")
        elif port:
            self._port = MetricsPort(self.gateway.settings.host, port, self.registry)

    async def stop(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
        if self._writer is not None and self.directory is not None:
            with contextlib.suppress(Exception):
                self._writer.write(self._families())  # the last counts stay in the totals
            self._writer.close()
            mark_process_dead(os.getpid(), self.directory)  # its gauges go
        if self._port is not None:
            await asyncio.to_thread(self._port.close)

    # --- reading --------------------------------------------------------------------------

    def read(self) -> list[Family]:
        """The families now. On another thread (the metrics port's), the event loop's
        thread samples Redis and reads them."""
        loop = self._loop
        if loop is None or threading.get_ident() == self._loop_thread:
            return self._families(fresh=True)
        timeout = self.gateway.settings.redis_timeout + 1
        return asyncio.run_coroutine_threadsafe(self._sampled_read(), loop).result(timeout)

    async def _sampled_read(self) -> list[Family]:
        await self.refresh()
        return self._families(fresh=True)

    def _families(self, fresh: bool = False) -> list[Family]:
        now = time.monotonic()
        if fresh or now - self._tasks_at > TASKS_MAX_AGE:
            self._tasks, self._tasks_at = len(asyncio.all_tasks()), now
        return families(self.gateway.hub.census(), self.sampled, self._tasks)

    async def refresh(self) -> None:
        """Sample Redis (readiness, the agent inbox) for the gauges that need it."""
        try:
            await asyncio.wait_for(sample(self.gateway, self.sampled),
                                   self.gateway.settings.redis_timeout)
        except TimeoutError:  # a frozen server: not ready, whatever the last sample said
            log.debug("sampling Redis for /metrics timed out")
            self.sampled.ready = dict.fromkeys(self.sampled.ready or ("redis",), False)

    async def _write(self, fresh: bool = False) -> None:
        await self.refresh()
        assert self._writer is not None
        self._writer.write(self._families(fresh))

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(FLUSH_INTERVAL)
            try:
                await self._write()
            except Exception:
                log.exception("writing this worker's metrics")

    async def expose(self, accept: str) -> tuple[bytes, str]:
        """The exposition, in the format ``accept`` asks for (text, or OpenMetrics)."""
        if self._writer is not None:
            # This worker's counts, fresh; the others' are at most FLUSH_INTERVAL old.
            await self._write(fresh=True)
        else:
            await self.refresh()
        encode, content_type = choose_encoder(accept)
        return encode(self.registry), content_type


def routes(exporter: Exporter) -> list[Route]:
    """``GET /metrics`` on the main port, unless ``GATEWAY_METRICS_PORT`` moves it."""
    if exporter.gateway.settings.metrics_port:
        return []

    async def metrics(request: Request) -> Response:
        body, content_type = await exporter.expose(request.headers.get("accept", ""))
        return Response(body, headers={"Content-Type": content_type})

    return [Route("/metrics", metrics, methods=["GET"])]
