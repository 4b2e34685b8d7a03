"""Shared fixtures: real Redis, PostgreSQL and MariaDB servers, one store per test, a fake clock."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from _doors import DOORS, Door
from _http_apps import Counter
from _http_servers import Process, free_port, uvicorn_argv
from _servers import MySQLServer, PostgresServer, RedisCluster, RedisServer

from retrysafe import Engine, Store, open_store

STORES = ["memory", "sqlite", "redis", "postgres", "mysql"]
SHARED_STORES = ["sqlite", "redis", "postgres", "mysql"]  # visible to several processes


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisCluster]:
    """3 primaries with a replica each. A test that fails a node over leaves it healthy."""
    with RedisCluster(3, 1) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    with PostgresServer() as server:
        yield server


@pytest.fixture(scope="session")
def mysql_server() -> Iterator[MySQLServer]:
    """MariaDB at InnoDB's default isolation, REPEATABLE READ."""
    with MySQLServer() as server:
        yield server


@pytest.fixture(scope="session")
def mysql_rc_server() -> Iterator[MySQLServer]:
    """A second MariaDB whose default isolation is READ COMMITTED."""
    with MySQLServer(isolation="READ-COMMITTED") as server:
        yield server


@dataclass
class StoreSpec:
    """How to open one test's store, in this process or another."""

    name: str
    url: str
    options: dict[str, Any] = field(default_factory=dict)
    #: ``create_engine`` keywords of the SQLAlchemy stores (``sqlalchemy-*``).
    engine_options: dict[str, Any] = field(default_factory=dict)

    def open(self) -> Store[Any]:
        if self.name.startswith("sqlalchemy-"):
            return open_sqlalchemy(self)
        return open_store(self.url, **self.options)


def open_sqlalchemy(spec: StoreSpec) -> Store[Any]:
    """A SQLAlchemy store on an engine of its own, which its close()/aclose() dispose."""
    import sqlalchemy
    from sqlalchemy.ext.asyncio import create_async_engine

    from retrysafe.sqlalchemy import SQLAlchemyStore

    if spec.name.endswith("-async"):
        aengine = create_async_engine(spec.url, **spec.engine_options)
        store: Any = SQLAlchemyStore(aengine, **spec.options)
        store_close, store_aclose = store.close, store.aclose

        def close() -> None:
            store_close()
            aengine.sync_engine.dispose(close=False)

        async def aclose() -> None:
            await store_aclose()
            await aengine.dispose()

        store.close, store.aclose = close, aclose
        return store  # type: ignore[no-any-return]
    engine = sqlalchemy.create_engine(spec.url, **spec.engine_options)
    store = SQLAlchemyStore(engine, **spec.options)
    store_close = store.close

    def close_sync() -> None:
        store_close()
        engine.dispose()

    store.close = close_sync
    return store  # type: ignore[no-any-return]


#: The SQLAlchemy stores: in tests/test_conformance.py, tests/test_races.py and
#: tests/test_sqlalchemy.py (the whole suite on them would double its time).
SQLALCHEMY_STORES = [
    "sqlalchemy-sqlite",
    "sqlalchemy-postgres",
    "sqlalchemy-sqlite-async",
    "sqlalchemy-postgres-async",
    "sqlalchemy-mysql",
    "sqlalchemy-mysql-async",
]
#: Room for the race tests' 64 threads (the default pool has 5 + 10 overflow).
SQLALCHEMY_POOL = {"pool_size": 10, "max_overflow": 20, "pool_timeout": 60}


#: How long a PostgreSQL store's caller waits for one of the pool's 10 connections. The
#: race tests queue 64 threads or 200 tasks on them; the default 2 s ran out on a busy
#: 2-core machine (a racer answered "store unavailable"). The store is up in these tests:
#: only a hung one waits this long.
POOL_WAIT = {"connect_timeout": 30.0}


def make_spec(name: str, request: pytest.FixtureRequest, tmp_path: Path) -> StoreSpec:
    """A store of kind ``name`` with a namespace of its own (file, prefix or table)."""
    tag = uuid.uuid4().hex[:12]
    if name == "memory":
        return StoreSpec(name, "memory://")
    if name == "sqlite":
        return StoreSpec(name, f"sqlite:///{tmp_path}/retrysafe.db?synchronous=normal")
    if name == "redis":
        server = request.getfixturevalue("redis_server")
        return StoreSpec(name, server.url, {"prefix": f"test-{tag}:"})
    if name == "redis-cluster":
        # Not in STORES: tests/test_redis_cluster.py runs the shared suites on it.
        cluster = request.getfixturevalue("redis_cluster")
        return StoreSpec(name, cluster.url, {"prefix": f"test-{tag}:"})
    if name == "postgres":
        server = request.getfixturevalue("postgres_server")
        return StoreSpec(name, server.url, {"table": f"t_{tag}", **POOL_WAIT})
    if name == "mysql":
        server = request.getfixturevalue("mysql_server")
        return StoreSpec(name, server.url, {"table": f"t_{tag}", **POOL_WAIT})
    if name == "postgres-partitioned":
        # Not in STORES: tests/test_postgres_partitioned.py runs the shared suites on it.
        # Partitions of 30 minutes, so that the tests' clock (moved by hours) makes
        # sweeps drop them; an hour ahead keeps the number of tables small.
        server = request.getfixturevalue("postgres_server")
        options = {
            "table": f"t_{tag}",
            "partitioned": True,
            **POOL_WAIT,
            "partition_interval": 1800.0,
            "partition_ahead": 3600.0,
        }
        return StoreSpec(name, server.url, options)
    if name.startswith("sqlalchemy-sqlite"):
        driver = "sqlite+aiosqlite" if name.endswith("-async") else "sqlite"
        return StoreSpec(
            name, f"{driver}:///{tmp_path}/retrysafe.db", engine_options=SQLALCHEMY_POOL
        )
    if name.startswith("sqlalchemy-postgres"):
        server = request.getfixturevalue("postgres_server")
        url = server.url.replace("postgresql://", "postgresql+psycopg://", 1)
        return StoreSpec(name, url, {"table": f"t_{tag}"}, engine_options=SQLALCHEMY_POOL)
    if name.startswith("sqlalchemy-mysql"):
        server = request.getfixturevalue("mysql_server")
        driver = "mysql+asyncmy" if name.endswith("-async") else "mysql+pymysql"
        url = server.url.replace("mysql://", f"{driver}://", 1)
        return StoreSpec(name, url, {"table": f"t_{tag}"}, engine_options=SQLALCHEMY_POOL)
    raise AssertionError(name)


def store_url(name: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The URL of a shared store of kind ``name`` with a namespace of its own, for
    server processes that open it from their environment."""
    tag = uuid.uuid4().hex[:12]
    if name == "sqlite":
        return f"sqlite:///{tmp_path}/shared.db"
    if name == "redis":
        return f"{request.getfixturevalue('redis_server').url}?prefix=t{tag}:"
    if name == "mysql":
        return f"{request.getfixturevalue('mysql_server').url}?table=t_{tag}"
    return f"{request.getfixturevalue('postgres_server').url}?table=t_{tag}"


@pytest.fixture(params=STORES)
def store_spec(request: pytest.FixtureRequest, tmp_path: Path) -> StoreSpec:
    return make_spec(request.param, request, tmp_path)


@pytest.fixture(params=SHARED_STORES)
def shared_spec(request: pytest.FixtureRequest, tmp_path: Path) -> StoreSpec:
    return make_spec(request.param, request, tmp_path)


@pytest.fixture
def store(store_spec: StoreSpec) -> Iterator[Store[Any]]:
    s = store_spec.open()
    yield s
    s.close()


@pytest.fixture
def shared_store(shared_spec: StoreSpec) -> Iterator[Store[Any]]:
    s = shared_spec.open()
    yield s
    s.close()


class Clock:
    """A clock the test moves by hand, so leases and TTLs expire without sleeping."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> Clock:
    return Clock()


class Api:
    """The engine's sync API, or its async API run on a loop of this test's own.

    The conformance tests call ``api.begin(...)`` and run unchanged in both modes.
    """

    def __init__(self, engine: Engine, mode: str) -> None:
        self.engine = engine
        self.mode = mode
        self.loop = asyncio.new_event_loop() if mode == "async" else None

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if self.loop is None:
            return getattr(self.engine, name)
        method = getattr(self.engine, "a" + name)
        loop = self.loop
        return lambda *args, **kwargs: loop.run_until_complete(method(*args, **kwargs))

    def close(self) -> None:
        if self.loop is not None:
            self.loop.run_until_complete(self.engine.store.aclose())
            self.loop.close()


@pytest.fixture(params=["sync", "async"])
def mode(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def make_api(store: Store[Any], clock: Clock, mode: str) -> Iterator[Callable[..., Api]]:
    """``make_api(**engine_options)``: an :class:`Api` over this test's store and clock."""
    made: list[Api] = []

    def make(**options: Any) -> Api:
        options.setdefault("clock", clock)
        api = Api(Engine(store, **options), mode)
        made.append(api)
        return api

    yield make
    for api in made:
        api.close()


@pytest.fixture
def api(make_api: Callable[..., Api]) -> Api:
    return make_api()


# -- HTTP front doors -------------------------------------------------------------------


@pytest.fixture(scope="session")
def counter(tmp_path_factory: pytest.TempPathFactory) -> Counter:
    """Run counts of the test API's handlers, shared with its worker processes."""
    return Counter(tmp_path_factory.mktemp("counters"))


@pytest.fixture(scope="session")
def upstream(counter: Counter) -> Iterator[str]:
    """The test API, bare, in a process of its own: what the gateway fronts."""
    port = free_port()
    argv = uvicorn_argv("_http_apps:upstream_from_env", port)
    env = {"RETRYSAFE_TEST_COUNTERS": str(counter.root)}
    with Process(argv, port, env, health="/count/none") as proc:
        yield proc.url


@pytest.fixture(
    scope="module", params=[(d, s) for d in DOORS for s in STORES], ids=lambda p: f"{p[0]}-{p[1]}"
)
def door(
    request: pytest.FixtureRequest, counter: Counter, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Door]:
    """Each front door (``_doors.DOORS``) on each store, served for one test module."""
    name, store_name = request.param
    spec = make_spec(store_name, request, tmp_path_factory.mktemp(store_name))
    store = spec.open()
    upstream = request.getfixturevalue("upstream") if name == "gateway" else None
    d = Door(name, spec, store, counter, upstream)
    with d.serve() as url:
        d.url = url
        yield d
    store.close()


@pytest.fixture
def tid() -> str:
    """A fresh test id: the key and run counter of one test's requests."""
    return uuid.uuid4().hex


@pytest.fixture
def memory() -> Iterator[Store[Any]]:
    """An in-memory store, where the kind of store does not matter."""
    s = open_store("memory://")
    yield s
    s.close()
