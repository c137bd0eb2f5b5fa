//! The quarantine's statements, next to `migrations/20261204000002_outbox_quarantine.sql`.

use crate::sql::{key_is, utf8};

/// An item's columns, in the order `item_from_row` reads them.
macro_rules! item {
    () => {
        "select id, source, consumer_name, producer_name, tenant_id, message_id, effect_id, \
                payload_sha256, payload_ref, reason_code, attempts, first_failed_at, \
                last_failed_at, handler_version, decision, decided_by, decided_at, \
                decision_reason, recovered_at \
         from tower_inbox.inbox_quarantine q "
    };
}

/// Items with no decision, oldest first; at most `$1`.
pub(super) const LIST_OPEN: &str = concat!(
    item!(),
    "where decision is null order by first_failed_at, id limit $1"
);

/// Items decided `repair` and not recovered, in the order of their decisions; at most `$1`.
pub(super) const LIST_AWAITING_RECOVERY: &str = concat!(
    item!(),
    "where decision = 'repair' and recovered_at is null order by decided_at, id limit $1"
);

/// Every item, newest first; at most `$1`.
pub(super) const LIST_ALL: &str = concat!(item!(), "order by id desc limit $1");

/// Item `$1`.
pub(super) const GET: &str = concat!(item!(), "where id = $1");

/// The items about one message, bound as `bind_identity!` binds it.
pub(super) const FOR_IDENTITY: &str = concat!(item!(), "where ", key_is!("q"), " order by id");

/// The newest item about the effect `$1`, open or decided (`inbox_quarantine_effect`).
pub(super) const LATEST_FOR_EFFECT: &str =
    concat!(item!(), "where effect_id = $1 order by id desc limit 1");

/// Items in state `$2` (`open`, `decided` or `all`), of reason code or source `$3` and
/// consumer `$4` when not null; open ones oldest first, the others newest first; at most
/// `$1`. For operators: the filters come before the limit.
pub(super) const LIST_MATCHING: &str = concat!(
    item!(),
    "where ($2 = 'all' or ($2 = 'open') = (decision is null)) \
       and ($3::text is null or reason_code = $3 or source = $3) \
       and ($4::text is null or consumer_name = $4) \
     order by case when $2 = 'open' then id else -id end limit $1"
);

/// Decides item `$1` (`$2` the decision, `$3` who, `$4` why) unless it is decided already.
pub(super) const DECIDE: &str = concat!(
    "update tower_inbox.inbox_quarantine \
     set decision = $2, decided_by = ",
    utf8!("$3"),
    ", decided_at = pg_catalog.now(), decision_reason = ",
    utf8!("$4"),
    " where id = $1 and decision is null \
     returning source, effect_id"
);

/// Whether item `$1` exists.
pub(super) const EXISTS: &str = "select id from tower_inbox.inbox_quarantine where id = $1";

/// Puts a dead effect (`$1`) back in the outbox, due at once.
pub(super) const REQUEUE_EFFECT: &str = "\
update tower_inbox.message_outbox \
set status = 'pending', attempts = 0, next_attempt_at = pg_catalog.now(), \
    lease_owner = null, lease_until = null \
where effect_id = $1 and status = 'dead'";
