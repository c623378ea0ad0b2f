-- Trainyard's PostgreSQL roles: one LOGIN role per service (scheduler, launcher, monitor, autoscaler), each
-- owning the schema of its name and nothing else; PUBLIC keeps no right on the database or its `public` schema.
-- The local stack makes the same (devstack/pglogins.py).
--
-- Run it connected to Trainyard's database as its administrator (a superuser, or what a managed service gives
-- instead: rds_superuser, cloudsqlsuperuser, azure_pg_admin, ...; such an administrator is made a member of each
-- role, which CREATE SCHEMA ... AUTHORIZATION requires), with the four passwords as psql variables:
--
--   psql "$ADMIN_URL" -v ON_ERROR_STOP=1 -v scheduler_password="$SCHEDULER_PASSWORD" \
--        -v launcher_password="$LAUNCHER_PASSWORD" -v monitor_password="$MONITOR_PASSWORD" \
--        -v autoscaler_password="$AUTOSCALER_PASSWORD" -f deploy/k8s/database-roles.sql
--
-- The Job of database-roles.yaml runs exactly that. It is safe to run again (after a change of a password, say):
-- every role gets the password given, and the rights become those below again. The server keeps a SCRAM verifier
-- of each password (password_encryption = scram-sha-256), never the password itself; make pg_hba.conf (or the
-- service's settings) ask every connection for one, with TLS (sslmode=require in the services' URLs).
\set ON_ERROR_STOP on
SET password_encryption = 'scram-sha-256';

-- The roles: no superuser, no replication, no bypassing row security (CREATE ROLE's defaults); no databases or
-- roles of their own, no rights inherited from roles granted to them.
SELECT format('CREATE ROLE %I', role) FROM unnest(ARRAY['scheduler', 'launcher', 'monitor', 'autoscaler']) AS role
WHERE NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = role) \gexec
ALTER ROLE scheduler LOGIN NOCREATEDB NOCREATEROLE NOINHERIT PASSWORD :'scheduler_password';
ALTER ROLE launcher LOGIN NOCREATEDB NOCREATEROLE NOINHERIT PASSWORD :'launcher_password';
ALTER ROLE monitor LOGIN NOCREATEDB NOCREATEROLE NOINHERIT PASSWORD :'monitor_password';
ALTER ROLE autoscaler LOGIN NOCREATEDB NOCREATEROLE NOINHERIT PASSWORD :'autoscaler_password';
-- An administrator that is no superuser must be a member of a role to make a schema it owns.
SELECT format('GRANT %I TO %I', role, current_user) FROM unnest(ARRAY['scheduler', 'launcher', 'monitor', 'autoscaler']) AS role
WHERE NOT (SELECT rolsuper FROM pg_roles WHERE rolname = current_user) AND NOT pg_has_role(current_user, role, 'MEMBER') \gexec

-- The database: nothing for PUBLIC; each role may connect, and create schemas (the services' migrations say
-- `CREATE SCHEMA IF NOT EXISTS <own>`, which PostgreSQL checks against that right even when the schema exists).
SELECT format('REVOKE ALL ON DATABASE %I FROM PUBLIC', current_database()) \gexec
REVOKE ALL ON SCHEMA public FROM PUBLIC;
SELECT format('GRANT CONNECT, CREATE ON DATABASE %I TO %I', current_database(), role)
FROM unnest(ARRAY['scheduler', 'launcher', 'monitor', 'autoscaler']) AS role \gexec

-- Each schema: its role's, with no right for anyone else.
CREATE SCHEMA IF NOT EXISTS scheduler AUTHORIZATION scheduler;
CREATE SCHEMA IF NOT EXISTS launcher AUTHORIZATION launcher;
CREATE SCHEMA IF NOT EXISTS monitor AUTHORIZATION monitor;
CREATE SCHEMA IF NOT EXISTS autoscaler AUTHORIZATION autoscaler;
ALTER SCHEMA scheduler OWNER TO scheduler;
ALTER SCHEMA launcher OWNER TO launcher;
ALTER SCHEMA monitor OWNER TO monitor;
ALTER SCHEMA autoscaler OWNER TO autoscaler;
REVOKE ALL ON SCHEMA scheduler FROM PUBLIC, launcher, monitor, autoscaler;
REVOKE ALL ON SCHEMA launcher FROM PUBLIC, scheduler, monitor, autoscaler;
REVOKE ALL ON SCHEMA monitor FROM PUBLIC, scheduler, launcher, autoscaler;
REVOKE ALL ON SCHEMA autoscaler FROM PUBLIC, scheduler, launcher, monitor;

-- What the services made in their schemas while they all logged in as one user (before these roles) passes to
-- the schema's role: tables, views and sequences (those of a serial column follow their table), then functions.
DO $handover$
DECLARE
    role text;
    item record;
BEGIN
    FOREACH role IN ARRAY ARRAY['scheduler', 'launcher', 'monitor', 'autoscaler'] LOOP
        FOR item IN SELECT c.oid::regclass AS name, c.relkind FROM pg_class c
            WHERE c.relnamespace = role::regnamespace AND c.relowner <> role::regrole
              AND c.relkind IN ('r', 'p', 'v', 'm', 'f', 'S')
              AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.classid = 'pg_class'::regclass
                              AND d.objid = c.oid AND d.deptype IN ('a', 'i'))
        LOOP
            EXECUTE format('ALTER %s %s OWNER TO %I',
                           CASE item.relkind WHEN 'S' THEN 'SEQUENCE' WHEN 'v' THEN 'VIEW'
                                WHEN 'm' THEN 'MATERIALIZED VIEW' WHEN 'f' THEN 'FOREIGN TABLE' ELSE 'TABLE' END,
                           item.name, role);
        END LOOP;
        FOR item IN SELECT p.oid::regprocedure AS name FROM pg_proc p
            WHERE p.pronamespace = role::regnamespace AND p.proowner <> role::regrole
        LOOP
            EXECUTE format('ALTER ROUTINE %s OWNER TO %I', item.name, role);
        END LOOP;
    END LOOP;
END
$handover$;
