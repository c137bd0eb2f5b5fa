//! The advisory lock a claim holds while its transaction runs.

use sha2::{Digest, Sha256};

use crate::identity::MessageIdentity;
use crate::schema::Schema;

/// The two keys of a message's advisory lock (`pg_try_advisory_xact_lock(int4, int4)`, a key
/// space apart from the one-`bigint` form), from the schema and the identity: the same for
/// every process, so that instances of a service see each other's claims in flight.
///
/// The first key names the consumer (a hash of the schema and the consumer name), the second
/// the message within it (a hash of the schema and the whole identity). So `pg_locks` shows,
/// per consumer, which transactions hold a claim right now, though their rows are not
/// committed yet ([`Inbox::claims_in_flight`](super::Inbox::claims_in_flight)). Two
/// identities of one consumer share a lock with one chance in 2^32; that only makes one wait
/// for the other. The derivation is versioned (`v2`): during a rolling deploy from a version
/// with another one, instances of the two versions do not see each other's locks, and a
/// duplicate reaching the other version waits in the claim's insert instead.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct ClaimLock(pub(super) i32, pub(super) i32);

impl ClaimLock {
    pub(crate) fn of(schema: &Schema, identity: &MessageIdentity) -> Self {
        let message = digest(schema, identity.key_parts());
        Self(consumer_class(schema, identity.consumer()), message)
    }
}

/// The first key of every claim lock of `consumer` in `schema`.
pub(crate) fn consumer_class(schema: &Schema, consumer: &str) -> i32 {
    digest(schema, [consumer])
}

fn digest<'a>(schema: &'a Schema, parts: impl IntoIterator<Item = &'a str>) -> i32 {
    let mut hasher = Sha256::new();
    hasher.update(b"tower-inbox/claim-lock/v2");
    for part in std::iter::once(schema.name()).chain(parts) {
        hasher.update((part.len() as u64).to_be_bytes());
        hasher.update(part.as_bytes());
    }
    let digest = hasher.finalize();
    i32::from_be_bytes([digest[0], digest[1], digest[2], digest[3]])
}
