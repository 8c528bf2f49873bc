"""Who shares the prefix cache (`graphc.server.isolation`) and the API keys that name tenants
(`graphc.server.auth`), without a model: the salts, the keys file, the middleware in-process."""

from __future__ import annotations

import asyncio

import httpx2
import pytest
from fastapi import FastAPI, Request

from graphc.errors import GraphcError
from graphc.server.auth import ApiKeyRequired, read_api_keys, server_keys, tenant, tenant_of
from graphc.server.isolation import CacheIsolation
from graphc.server.translate import BadRequest

A, B = tenant_of("key-a"), tenant_of("key-b")


def test_shared_mode_salts_only_what_gives_a_cache_salt():
    shared = CacheIsolation("shared")
    assert shared.salt(None, A) is None and shared.salt(None, None) is None
    assert shared.salt("s", A) == shared.salt("s", B) == shared.salt("s", None) != shared.salt("t", A)


def test_api_key_mode_gives_each_key_its_own_salt_divided_by_cache_salt():
    by_key = CacheIsolation("api-key")
    salts = {by_key.salt(given, who) for given in (None, "s", "t") for who in (A, B)}
    assert len(salts) == 6 and None not in salts
    assert by_key.salt("s", A) == by_key.salt("s", A)


def test_no_cache_salt_can_spell_a_tenants_salt():
    assert CacheIsolation("api-key").salt(None, A) not in {CacheIsolation("shared").salt(f"tenant:{A}", None),
                                                           CacheIsolation("salt").salt(f"tenant:{A}", A)}


def test_salt_mode_refuses_a_request_without_a_salt_naming_the_field():
    with pytest.raises(BadRequest) as refused:
        CacheIsolation("salt").salt(None, A)
    assert refused.value.param == "cache_salt" and str(refused.value).startswith("cache_salt: this server")
    assert CacheIsolation("salt").salt("s", A) == CacheIsolation("shared").salt("s", B)


@pytest.mark.parametrize("mode, keys, message", [
    ("api-key", (), "--prefix-cache-isolation api-key needs the server's keys: give --api-key or --api-keys-file"),
    ("tenant", ("k",), "--prefix-cache-isolation 'tenant'; expected one of shared, api-key, salt"),
])
def test_isolation_that_cannot_work_is_refused(mode, keys, message):
    with pytest.raises(GraphcError, match="^" + message.replace("(", r"\(").replace(")", r"\)") + "$"):
        CacheIsolation(mode).check(keys)
    CacheIsolation("api-key").check(("k",))


def test_a_keys_file_gives_one_key_a_line_and_adds_to_the_api_key(tmp_path):
    path = tmp_path / "keys"
    path.write_text("alpha\n\n  beta  \ngamma\n")
    assert read_api_keys(path) == ("alpha", "beta", "gamma")
    assert server_keys("beta", path) == ("beta", "alpha", "gamma")
    assert server_keys(None, None) == () and server_keys("k", None) == ("k",)


@pytest.mark.parametrize("text, message", [
    ("alpha\nbe ta\n", "{path}:2: a key must be printable ASCII without spaces (a Bearer token)"),
    ("alpha\nbeta\nalpha\n", "{path}:3: the key of line 1 again"),
    ("\n \n", "{path}: no key in it (one a line)"),
])
def test_a_bad_keys_file_is_refused_naming_the_line(tmp_path, text, message):
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(GraphcError) as refused:
        read_api_keys(path)
    assert str(refused.value) == "--api-keys-file " + message.format(path=path)


def test_a_missing_keys_file_is_refused(tmp_path):
    with pytest.raises(GraphcError, match="^--api-keys-file .*/absent: cannot read it"):
        read_api_keys(tmp_path / "absent")


def test_the_middleware_names_the_tenant_of_the_key_given():
    app = FastAPI()

    @app.get("/who")
    async def who(request: Request):
        return {"tenant": tenant(request.scope)}

    guarded = ApiKeyRequired(app, ("key-a", "key-b"))

    async def ask(key: str | None) -> httpx2.Response:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=guarded), base_url="http://graphc") as client:
            return await client.get("/who", headers=headers)

    answers = [asyncio.run(ask(key)) for key in ("key-a", "key-b", "key-c", None)]
    assert [a.status_code for a in answers] == [200, 200, 401, 401]
    assert [a.json()["tenant"] for a in answers[:2]] == [A, B]
    assert asyncio.run(_unguarded(app)) == {"tenant": None}


async def _unguarded(app) -> dict:
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://graphc") as client:
        return (await client.get("/who")).json()
