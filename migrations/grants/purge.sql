-- tower-inbox: what the retention purge needs beyond service.sql, which it is applied after
-- (see there for how). The purge deletes in batches from these four tables; its locking scan
-- (FOR UPDATE SKIP LOCKED) needs the UPDATE that service.sql grants. Give it to the role
-- that runs a Purger (often the service's own) or `tower-inbox purge --yes`.
grant delete
    on {schema}.consumer_inbox, {schema}.consumer_inbox_failure,
       {schema}.message_outbox, {schema}.inbox_quarantine
    to {role};
