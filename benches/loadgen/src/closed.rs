//! The closed loop, the default: each connection sends its next request as soon as the
//! previous response has been read, so the service sets the pace.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use crate::args::Limit;
use crate::client::{join, Sender, Slot};
use crate::plan::Plan;

/// When a phase ends.
#[derive(Clone)]
enum Stop {
    At(Instant),
    /// Requests left to send over all connections.
    Budget(Arc<AtomicU64>),
}

impl Stop {
    /// Whether one more request may be sent.
    fn admit(&self, now: Instant) -> bool {
        match self {
            Stop::At(deadline) => now < *deadline,
            Stop::Budget(left) => left
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                .is_ok(),
        }
    }
}

/// One connection's closed loop for one phase.
async fn drive(mut slot: Slot, plan: Arc<Plan>, mut sender: Option<Sender>, stop: Stop) -> Slot {
    while stop.admit(Instant::now()) {
        slot.send(&plan, &mut sender, None).await;
    }
    slot
}

/// Runs one phase that started at `started` on every connection (`slots` and their opened
/// `senders`) until `limit`, and hands the slots back.
pub(crate) async fn run(
    plan: &Arc<Plan>,
    slots: Vec<Slot>,
    senders: Vec<Option<Sender>>,
    limit: Limit,
    started: Instant,
) -> Result<Vec<Slot>, String> {
    let stop = match limit {
        Limit::Duration(d) => Stop::At(started + d),
        Limit::Requests(n) => Stop::Budget(Arc::new(AtomicU64::new(n))),
    };
    let tasks: Vec<_> = slots
        .into_iter()
        .zip(senders)
        .map(|(slot, sender)| tokio::spawn(drive(slot, plan.clone(), sender, stop.clone())))
        .collect();
    join(tasks).await
}
