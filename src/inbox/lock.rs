//! The advisory lock a claim holds while its transaction runs.

use sha2::{Digest, Sha256};

use crate::identity::MessageIdentity;
use crate::schema::Schema;

/// The two keys of a message's advisory lock (`pg_try_advisory_xact_lock(int4, int4)`, a key
/// space apart from the one-`bigint` form), from the schema and the identity: the same for
/// every process, so that instances of a service see each other's claims in flight. Two
/// identities that share a lock (one chance in 2^64) only make one wait for the other.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct ClaimLock(pub(super) i32, pub(super) i32);

impl ClaimLock {
    pub(crate) fn of(schema: &Schema, identity: &MessageIdentity) -> Self {
        let mut hasher = Sha256::new();
        hasher.update(b"tower-inbox/claim-lock/v1");
        for part in std::iter::once(schema.name()).chain(identity.key_parts()) {
            hasher.update((part.len() as u64).to_be_bytes());
            hasher.update(part.as_bytes());
        }
        let digest = hasher.finalize();
        let half = |at: usize| {
            i32::from_be_bytes([digest[at], digest[at + 1], digest[at + 2], digest[at + 3]])
        };
        Self(half(0), half(4))
    }
}
