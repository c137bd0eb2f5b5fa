-- tower-inbox: what the service's role needs on top of service.sql when the schema has the
-- partitioned layout (migrations/partitioned/). The claim calls inbox_committed, a
-- SECURITY INVOKER function (it reads consumer_inbox with the caller's own privileges);
-- the migration revoked EXECUTE from PUBLIC, so it is granted here.
grant execute on function {schema}.inbox_committed(text, text, text, text) to {role};
