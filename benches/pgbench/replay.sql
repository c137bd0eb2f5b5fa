-- replay: read a recorded response by primary key, outside any transaction (src/inbox/sql.rs
-- LOOKUP). run.sh first records :rows processed rows under the producer 'replay', with keys
-- 1 to :rows; this picks one at random.
\set key random(1, :rows)
select payload_sha256, handler_version, processed_at is not null as processed,
       response_status, response_header_names, response_header_values, response_body
from consumer_inbox
where consumer_name = 'credits' and producer_name = 'replay' and tenant_id = '' and message_id = :key;
