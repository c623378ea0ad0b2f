"""The PostgreSQL logins of a stack's services: a role per service that owns its schema and nothing else.

Each service (`scheduler`, `launcher`, `monitor`, `autoscaler`) logs in as the role of its name, with a random
password of its own in `home/postgres-auth/<service>.password` (mode 0600; like all of `home`, jobs never see
it). The role is no superuser, may create no database and no role, owns its schema (the one its event log lives
in), and has no right on any other service's schema; PUBLIC keeps no right on the database or its `public`
schema. `provision_roles` makes it so, and can run again at every start: it keeps the passwords of the files.

What each service connects with is written to `home/postgres-auth/services.json` and handed to that service
alone (`database_login_env`): its URL (`DATABASE_URL`, naming its role) and its password file
(`TRAINYARD_DATABASE_PASSWORD_FILE`). Node agents and the CLI get neither. With a database of the operator's
own (`DATABASE_URL` given to `make up`) every service gets that URL as it is: their server, their roles.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import urllib.parse
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from devstack.servers import LOGINS_FOLDER, scram_verifier, secret, secret_file
from libs.settings import DATABASE_PASSWORD_FILE_VARIABLE

LOGINS_FILE = "services.json"
# What a service role may not do: be or become a superuser, create databases or roles, replicate, bypass
# row security, or use the rights of roles granted to it.
ROLE_ATTRIBUTES = "LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION NOBYPASSRLS NOINHERIT"
# Serialises two stacks provisioning one database at once.
_PROVISION_LOCK = 0x7472_6169_6E79

T = TypeVar("T")


def quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def quote_literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def role_statements(role: str, verifier: str, *, exists: bool) -> list[str]:
    """Create (or bring back to) service role `role`, logging in with the password of scram `verifier`."""
    verb = "ALTER" if exists else "CREATE"
    return [f"{verb} ROLE {quote_ident(role)} {ROLE_ATTRIBUTES} PASSWORD {quote_literal(verifier)}"]


def database_statements(database: str, roles: Sequence[str]) -> list[str]:
    """PUBLIC loses every right on `database` and its `public` schema; each role may connect. CREATE on the
    database too: the services' migrations say `CREATE SCHEMA IF NOT EXISTS <own>`, which PostgreSQL checks
    against that right even when the schema exists (libs/eventstore/store.py)."""
    db = quote_ident(database)
    return [f"REVOKE ALL ON DATABASE {db} FROM PUBLIC", "REVOKE ALL ON SCHEMA public FROM PUBLIC",
            *(f"GRANT CONNECT, CREATE ON DATABASE {db} TO {quote_ident(role)}" for role in roles)]


def schema_statements(role: str, others: Iterable[str]) -> list[str]:
    """Schema `role` belongs to role `role`, and so does everything in it (what an earlier stack made there as
    the administrator); PUBLIC and the other service roles have no right on it."""
    schema, owner = quote_ident(role), quote_ident(role)
    return [
        f"CREATE SCHEMA IF NOT EXISTS {schema} AUTHORIZATION {owner}",
        f"ALTER SCHEMA {schema} OWNER TO {owner}",
        f"REVOKE ALL ON SCHEMA {schema} FROM PUBLIC",
        *(f"REVOKE ALL ON SCHEMA {schema} FROM {quote_ident(other)}" for other in others),
        # Tables, views and sequences of their own (not those of a serial column, which follow their table),
        # then functions.
        f"""DO $handover$
        DECLARE item record;
        BEGIN
            FOR item IN SELECT c.oid::regclass AS name, c.relkind FROM pg_class c
                WHERE c.relnamespace = {quote_literal(role)}::regnamespace
                  AND c.relowner <> {quote_literal(role)}::regrole AND c.relkind IN ('r', 'p', 'v', 'm', 'f', 'S')
                  AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.classid = 'pg_class'::regclass
                                  AND d.objid = c.oid AND d.deptype IN ('a', 'i'))
            LOOP
                EXECUTE format('ALTER %s %s OWNER TO %I',
                               CASE item.relkind WHEN 'S' THEN 'SEQUENCE' WHEN 'v' THEN 'VIEW'
                                    WHEN 'm' THEN 'MATERIALIZED VIEW' WHEN 'f' THEN 'FOREIGN TABLE' ELSE 'TABLE' END,
                               item.name, {quote_literal(role)});
            END LOOP;
            FOR item IN SELECT p.oid::regprocedure AS name FROM pg_proc p
                WHERE p.pronamespace = {quote_literal(role)}::regnamespace
                  AND p.proowner <> {quote_literal(role)}::regrole
            LOOP
                EXECUTE format('ALTER ROUTINE %s OWNER TO %I', item.name, {quote_literal(role)});
            END LOOP;
        END
        $handover$""",
    ]


def provision_statements(database: str, verifiers: Mapping[str, str], existing: Iterable[str]) -> list[str]:
    """Everything `provision_roles` runs, in order, for roles (by name) with these password verifiers."""
    roles, existing = list(verifiers), set(existing)
    statements = [s for role in roles for s in role_statements(role, verifiers[role], exists=role in existing)]
    statements += database_statements(database, roles)
    for role in roles:
        statements += schema_statements(role, [other for other in roles if other != role])
    return statements


async def provision_roles(admin_url: str, passwords: Mapping[str, str]) -> None:
    """On the database of `admin_url` (a superuser's), a role per entry of `passwords` (role name: password) that
    owns the schema of its name and nothing else. Idempotent: every role gets the password given again."""
    import asyncpg

    verifiers = {role: scram_verifier(password) for role, password in passwords.items()}
    if not await is_superuser(admin_url):
        raise PermissionError("the services' roles can only be made by a superuser of the database server")
    conn = await asyncpg.connect(admin_url)
    try:
        for attempt in range(2):  # roles belong to the server: a stack on another database may make them first
            try:
                async with conn.transaction():
                    await conn.execute("SELECT pg_advisory_xact_lock($1)", _PROVISION_LOCK)
                    database = str(await conn.fetchval("SELECT current_database()"))
                    existing = [row["rolname"] for row in await conn.fetch(
                        "SELECT rolname FROM pg_roles WHERE rolname = any($1::text[])", list(verifiers))]
                    for statement in provision_statements(database, verifiers, existing):
                        await conn.execute(statement)
                return
            except asyncpg.DuplicateObjectError:
                if attempt == 1:
                    raise
    finally:
        await conn.close()


async def is_superuser(url: str) -> bool:
    """Whether the user of `url` is a superuser of its server, who can make the services' roles."""
    import asyncpg

    conn = await asyncpg.connect(url)
    try:
        return bool(await conn.fetchval("SELECT rolsuper FROM pg_roles WHERE rolname = current_user"))
    finally:
        await conn.close()


def role_url(url: str, role: str) -> str:
    """`url` with `role` as its user and no password: the role's password comes from its file."""
    parts = urllib.parse.urlsplit(url)
    _, _, host = parts.netloc.rpartition("@")
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{urllib.parse.quote(role, safe='')}@{host}"))


def provision_service_logins(home: Path, services: Sequence[str], database_url: str, *,
                             admin_url: str | None) -> None:
    """Write what each of `services` connects with. With `admin_url` (a superuser's, on the database of
    `database_url`): their roles, made or brought up to date, each with its password file. Without: every
    service uses `database_url` as it is (a server of the operator's, with roles of their own)."""
    logins: dict[str, dict[str, str]]
    if admin_url is None:
        logins = {service: {"DATABASE_URL": database_url} for service in services}
    else:
        passwords = {service: secret(home, service)[0] for service in services}
        run_to_end(provision_roles(admin_url, passwords))
        logins = {service: {"DATABASE_URL": role_url(database_url, service),
                            DATABASE_PASSWORD_FILE_VARIABLE: str(secret_file(home, service))}
                  for service in services}
    path = home / LOGINS_FOLDER / LOGINS_FILE
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    partial = path.with_suffix(".tmp")
    partial.touch(mode=0o600)
    partial.write_text(json.dumps(logins, indent=1))
    partial.replace(path)


def database_login_env(home: Path, service: str) -> dict[str, str]:
    """Service `service`'s database variables, as `provision_service_logins` wrote them; nothing when it did not."""
    try:
        logins: dict[str, dict[str, str]] = json.loads((home / LOGINS_FOLDER / LOGINS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return dict(logins.get(service, {}))


def run_to_end(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run `coroutine` to its end from synchronous code, also when an event loop runs in this thread (the test
    harness is built inside one): then on a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()
