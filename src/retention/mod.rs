//! Retention: how long the inbox must remember a message, and deleting what it no longer
//! must.
//!
//! Retention is part of correctness. Inbox rows cannot always live forever, but deleting one
//! too soon makes an old delivery new again: a late copy of the message is claimed as
//! first-seen and applied a second time.
//!
//! ## The window comes from failure scenarios
//!
//! A [`RetentionPolicy`] is not a TTL. It is built from the ways a copy of an already
//! processed message can still arrive ([`Scenario`]): the client's or broker's retry
//! horizon, offset rewinds, dead-letter redrives, outages, backup restores, planned replays,
//! and any path of your own. Each is declared with a horizon: **how long after the message
//! was first processed a copy can still arrive through that path**. An outage holds
//! redeliveries back until it ends, so the outage tolerance is added to the retry horizon.
//! The window is the longest path plus a safety margin:
//!
//! ```text
//! window = max(retry horizon + outage tolerance, offset rewind, dead-letter redrive,
//!              backup restore, planned replay, custom...) + safety margin
//! ```
//!
//! The policy says which scenario sets the window (its `Display` lists them all and marks
//! that one), and refuses to exist without a scenario, with a zero duration, or with an
//! explicit window (a storage budget) shorter than a scenario requires.
//!
//! ```
//! use std::time::Duration;
//! use tower_inbox::retention::{RetentionError, RetentionPolicy};
//!
//! const DAY: Duration = Duration::from_secs(24 * 3600);
//! let scenarios = || {
//!     RetentionPolicy::builder()
//!         .retry_horizon(DAY)            // producers retry for a day
//!         .outage_tolerance(3 * DAY)     // we survive a three-day outage
//!         .offset_rewind(7 * DAY)        // offsets may be rewound a week
//!         .dead_letter_redrive(14 * DAY) // dead letters are redriven within two weeks
//!         .safety_margin(DAY)
//! };
//! let policy = scenarios().build()?;
//! assert_eq!(policy.window(), 15 * DAY);
//! let report = policy.to_string();
//! assert!(report.starts_with("retention window 15d: dead-letter redrive 14d + safety margin 1d"));
//! assert!(report.contains("retry horizon: 1d + outage tolerance 3d = 4d"));
//! assert!(report.contains("dead-letter redrive: 14d  <- sets the window"));
//!
//! // A ten-day storage budget would forget messages a redrive can still bring back.
//! let budget = scenarios().window(10 * DAY).build();
//! assert!(matches!(budget, Err(RetentionError::WindowTooShort { .. })));
//! # Ok::<(), RetentionError>(())
//! ```
//!
//! ## The purge
//!
//! A [`Purger`] deletes only what its policies no longer require, in small batches that do
//! not block claims; [`Purger::dry_run`] reports what it would delete, per table, with the
//! cutoffs, and deletes nothing; [`Purger::run`] is the background task. The inbox, the
//! outbox and the quarantine each get their own policy. See [`Purger`] for exactly what is
//! and is never deleted.
//!
//! ## The guard
//!
//! Even a correct window can be outlived: a dead letter redriven after a year. A consumer
//! that knows when a message was produced uses a [`RetentionGuard`]: a first-seen message
//! produced before the window may be one the inbox has forgotten, so it is quarantined
//! instead of processed ([`GuardedClaim::Expired`]). The HTTP layer has no production
//! timestamp and relies on the window alone.
//!
//! ## Partitioning the inbox by time
//!
//! For very large inboxes, deleting row by row costs more than it should; dropping a whole
//! partition costs almost nothing. The [partitioned layout](crate::partition) partitions
//! `consumer_inbox` by `received_at`, and the [`Purger`] then drops each partition whose
//! whole range is past the window (after moving the rows it must keep into the default
//! partition) instead of deleting its rows in batches.
//!
//! A unique key on a partitioned table must include the partition key, so PostgreSQL
//! enforces it per partition only: a redelivery received later would land in a newer
//! partition and conflict with nothing there. The partitioned claim therefore does not rely
//! on the primary key: it takes the key's claim lock in a statement of its own and then
//! looks for a committed row of the key in every partition, with a snapshot taken after the
//! lock was granted. That is why `received_at` can be the partition key (no message time is
//! needed), and why only `READ COMMITTED` is allowed with that layout.
//!
//! Dropping partitions forgets exactly what the batched purge forgets: rows received and
//! processed before the window, other than migration steps and rows an open quarantine item
//! refers to. A partition whose range straddles the cutoff waits until its whole range is
//! past it, so the table holds up to one partition step more than the window. The guard
//! works as with the plain layout.

mod guard;
mod policy;
mod preview;
mod purge;
mod report;
pub(crate) mod sql;

pub use guard::{ExpiredMessage, GuardedClaim, RetentionGuard};
pub use policy::{
    HumanDuration, RedeliveryPath, RetentionError, RetentionPolicy, RetentionPolicyBuilder,
    Scenario, MAX_HORIZON,
};
pub use purge::{Purger, PurgerBuilder};
pub use report::{PurgeError, PurgeReport, PurgedTable, TablePurge};
