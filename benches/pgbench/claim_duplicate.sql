-- claim duplicate: a duplicate met by the claim, one statement per round trip: a
-- transaction, the claim that finds the recorded row, a rollback. (The layer now sends the
-- BEGIN with a claim that raises, then the ROLLBACK with the read of the row: two round trips
-- as here, but an expected error is not something pgbench can script.) Compare with
-- replay.sql, the read alone. Uses the rows run.sh recorded for replay.sql.
\set key random(1, :rows)
BEGIN ISOLATION LEVEL READ COMMITTED;
select claimed, payload_sha256, handler_version, processed_at is not null as processed,
       response_status, response_header_names, response_header_values, response_body
from tower_inbox_claim('credits', 'replay', '', :key,
    '2f0c6a7a3ac4b3b35e0c8c4e1b7d3f4a9a1e5c2d6b8f0e1a2c3d4e5f6a7b8c9d', '1', 2000);
ROLLBACK;
