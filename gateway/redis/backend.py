"""Where Redis is: one server, or a cluster whose slots move between nodes.

``GATEWAY_REDIS_URL`` may name a single server or any node of a Redis (or Valkey) Cluster;
:meth:`Backend.connect` asks the server (``cluster_enabled``) and needs no other setting.

The gateway's own hot paths (the auto-pipeline, the pub/sub readers) talk to nodes
directly: :meth:`Backend.node` names the node that owns a key's slot now, with a client of
its own. Which node that is comes from redis-py's cluster slot map, which
:meth:`Backend.moved` and :meth:`Backend.refresh` keep current after a failover or a slot
migration. Rare commands (lists, the agent inbox) use :attr:`Backend.client`, a plain or
cluster client that routes by key itself.

Every connection has an explicit timeout (``GATEWAY_REDIS_TIMEOUT``) for connecting and for
each reply, so a frozen server fails calls (and ``/readyz``) in bounded time.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import AskError, RedisError

from ..config import Settings
from .counters import REDIS
from .link import PipelinedLink

log = logging.getLogger("gateway.backend")

MAX_CONNECTIONS = 100  # per node and process, the pub/sub connection included

Client = aioredis.Redis | RedisCluster


class Node:
    """One server: its name (``host:port``, or the URL of a single server), a client, and
    the pipelined connection the auto-pipeline writes its batches to."""

    __slots__ = ("_link", "_linking", "client", "connection_kwargs", "name")

    def __init__(self, name: str, pool: aioredis.ConnectionPool) -> None:
        self.name = name
        self.client = aioredis.Redis.from_pool(pool)
        self.connection_kwargs: dict[str, Any] = dict(pool.connection_kwargs)
        self._link: PipelinedLink | None = None
        self._linking: asyncio.Future[PipelinedLink] | None = None

    @property
    def open_link(self) -> PipelinedLink | None:
        """The pipelined connection when it is up, else None (:meth:`link` makes one)."""
        link = self._link
        return link if link is not None and link.open else None

    async def link(self) -> PipelinedLink:
        """The pipelined connection, made on first use and again once it has closed;
        concurrent callers share one connect (and its failure)."""
        link = self.open_link
        if link is not None:
            return link
        if self._linking is None:
            self._linking = asyncio.ensure_future(self._open_link())
        return await asyncio.shield(self._linking)

    async def _open_link(self) -> PipelinedLink:
        try:
            kwargs = dict(self.connection_kwargs, health_check_interval=0)
            link = PipelinedLink(self.name, kwargs.get("socket_timeout"))
            pool = self.client.connection_pool
            await link.take_over(pool.connection_class(**kwargs))  # type: ignore[arg-type]
            self._link = link
            return link
        finally:
            self._linking = None

    def close_link(self) -> None:
        if self._link is not None:
            self._link.close()
            self._link = None

    def __repr__(self) -> str:
        return f"Node({self.name})"

    def new_connection(self) -> aioredis.Connection:
        """A connection of its own, outside the pool (for pub/sub), with no reply timeout:
        pub/sub readers wait for messages indefinitely and probe the link themselves."""
        pool = self.client.connection_pool
        # RESP2: pushes come back as replies to read, not to a RESP3 push handler.
        kwargs = dict(self.connection_kwargs, socket_timeout=None, health_check_interval=0,
                      protocol=2)
        connection: aioredis.Connection = pool.connection_class(**kwargs)  # type: ignore[assignment]
        return connection


def _pool(url: str, settings: Settings, **overrides: Any) -> aioredis.BlockingConnectionPool:
    # A blocking pool makes a burst (a reconnect storm's subscribes) wait for a free
    # connection instead of failing with MaxConnectionsError.
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=MAX_CONNECTIONS, timeout=settings.redis_timeout,
        socket_timeout=settings.redis_timeout, socket_connect_timeout=settings.redis_timeout,
        decode_responses=False, health_check_interval=30,
    )
    pool.connection_kwargs.update(overrides)
    return pool


class Backend:
    """The Redis this process uses, single or clustered."""

    def __init__(self, settings: Settings, client: Client, seed: Node | None) -> None:
        self.settings = settings
        self.client = client
        self.cluster = isinstance(client, RedisCluster)
        self._seed = seed  # the one node of a single server
        self._nodes: dict[str, Node] = {}
        self._refreshing: asyncio.Task[None] | None = None

    @classmethod
    def of(cls, client: Client, settings: Settings) -> Backend:
        """A backend over a client made elsewhere (an agent worker's, a test's)."""
        if isinstance(client, RedisCluster):
            return cls(settings, client, None)
        return cls(settings, client, Node("redis", client.connection_pool))

    @classmethod
    async def connect(cls, settings: Settings) -> Backend:
        """Reach ``settings.redis_url`` and find out whether it is a cluster node."""
        seed = Node(settings.redis_url, _pool(settings.redis_url, settings))
        info = await seed.client.info("cluster")
        if not int(info.get("cluster_enabled", 0)):
            return cls(settings, seed.client, seed)
        await seed.client.aclose()
        cluster = RedisCluster.from_url(
            settings.redis_url, decode_responses=False,
            socket_timeout=settings.redis_timeout,
            socket_connect_timeout=settings.redis_timeout,
        )
        await cluster.initialize()
        log.info("Redis Cluster: %d primaries", len(cluster.get_primaries()))
        return cls(settings, cluster, None)

    # --- which node -----------------------------------------------------------------

    @staticmethod
    def slot(key: str | bytes) -> int:
        return key_slot(key.encode() if isinstance(key, str) else key)

    def node(self, key: str | bytes) -> Node:
        """The node that owns ``key``'s slot, as far as this process knows."""
        if self._seed is not None:
            return self._seed
        return self.node_of_slot(self.slot(key))

    def node_of_slot(self, slot: int) -> Node:
        if self._seed is not None:
            return self._seed
        assert isinstance(self.client, RedisCluster)
        owner = self.client.nodes_manager.get_node_from_slot(slot)
        return self.node_at(owner.host, int(owner.port))

    def primaries(self) -> list[Node]:
        if self._seed is not None:
            return [self._seed]
        assert isinstance(self.client, RedisCluster)
        return [self.node_at(n.host, int(n.port)) for n in self.client.get_primaries()]

    def node_at(self, host: str, port: int) -> Node:
        """A cluster node by address (an ``ASK`` redirect names one)."""
        if self._seed is not None:
            return self._seed
        name = f"{host}:{port}"
        node = self._nodes.get(name)
        if node is None:
            url = self.settings.redis_url
            node = self._nodes[name] = Node(name, _pool(url, self.settings, host=host, port=port))
        return node

    # --- keeping the slot map current ---------------------------------------------------

    async def moved(self, error: AskError) -> None:
        """A MOVED reply: the slot's owner changed (a failover, a migration finished)."""
        if isinstance(self.client, RedisCluster):
            await self.client.nodes_manager.move_slot(error)

    async def refresh(self) -> None:
        """Reload the whole slot map (after a node failed or dropped our subscriptions).
        Concurrent callers share one reload."""
        if not isinstance(self.client, RedisCluster):
            return
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.ensure_future(self._reload(self.client))
        await asyncio.shield(self._refreshing)

    @staticmethod
    async def _reload(client: RedisCluster) -> None:
        REDIS.slot_map_reloads += 1
        try:
            await client.nodes_manager.initialize()
        except (RedisError, OSError) as exc:
            log.warning("reloading the cluster's slot map: %s", exc)

    # --- health ------------------------------------------------------------------------

    async def health(self) -> dict[str, str]:
        """Each dependency's state, ``"ok"`` or why not (``/readyz``)."""
        if self._seed is not None:
            return {"redis": await _ping(self._seed)}
        assert isinstance(self.client, RedisCluster)
        report: dict[str, str] = {}
        for node in self.primaries():
            report[f"redis {node.name}"] = await _ping(node)
        try:
            state = (await self.client.cluster_info()).get("cluster_state", "?")
        except (RedisError, OSError) as exc:
            state = f"unreachable: {exc}"
        report["cluster"] = "ok" if state == "ok" else str(state)
        return report

    async def aclose(self) -> None:
        if self._seed is not None:
            self._seed.close_link()
        for node in self._nodes.values():
            node.close_link()
            await node.client.aclose()
        await self.client.aclose()


async def _ping(node: Node) -> str:
    try:
        await node.client.ping()
        return "ok"
    except (RedisError, OSError) as exc:
        return f"unreachable: {exc}"
