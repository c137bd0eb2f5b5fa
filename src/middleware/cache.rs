//! The opt-in in-process cache of completed responses.

use std::sync::Arc;

use quick_cache::sync::Cache;
use quick_cache::Weighter;

use crate::fingerprint::Fingerprint;
use crate::identity::MessageIdentity;
use crate::inbox::InboxEntry;

/// A bounded in-process cache of completed responses, so that a duplicate is answered
/// without a database round trip.
///
/// It holds what a commit recorded, keyed by the full identity (consumer, producer, tenant,
/// message ID), with the payload fingerprint beside it: a duplicate with the same
/// fingerprint gets the recorded response; one with a different fingerprint is still an
/// identity conflict (answered and quarantined as usual). Only committed records go in,
/// and a recorded response never changes, so a cached answer is always the one the database
/// holds — or held, before the retention purge deleted it, which only makes the cache more
/// protective, never less. Each process has its own cache; a miss falls through to the
/// database.
///
/// It is bounded by entries and by bytes; the least useful entries are evicted first. An
/// entry weighs its body, headers, identity and version plus about 600 bytes of
/// bookkeeping (what an entry costs in resident memory, allocator overhead included), so
/// the byte limit is close to the memory the cache takes. Memory stays flat however many commands pass.
///
/// ```
/// use tower_inbox::middleware::ReplayCache;
///
/// // At most 100 000 responses and 64 MiB.
/// let cache = ReplayCache::new(100_000, 64 * 1024 * 1024).unwrap();
/// assert!(cache.is_empty());
/// assert!(ReplayCache::new(0, 1024).is_err());
/// ```
#[derive(Clone)]
pub struct ReplayCache {
    entries: Arc<Cache<MessageIdentity, Arc<Cached>, ByWeight>>,
    max_entries: usize,
    max_bytes: u64,
}

/// One completed command: its fingerprint and its record.
#[derive(Debug)]
pub(crate) struct Cached {
    pub(crate) fingerprint: Fingerprint,
    pub(crate) entry: InboxEntry,
    /// Its weight, computed once.
    weight: u64,
}

/// Weighs an entry by its bytes, but never below `max_bytes / max_entries`, so that the
/// byte budget also bounds the number of entries.
#[derive(Clone)]
struct ByWeight;

impl Weighter<MessageIdentity, Arc<Cached>> for ByWeight {
    fn weight(&self, _key: &MessageIdentity, value: &Arc<Cached>) -> u64 {
        value.weight
    }
}

/// [`ReplayCache::new`] was given a zero limit: the cache could hold nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the replay cache needs a positive entry and byte limit")]
pub struct EmptyCache;

/// The fixed memory an entry costs besides the bytes counted in [`ReplayCache::insert`]: the
/// map's slot, the `Arc`, the copied identity, and the allocator's share of each
/// allocation. Measured as resident memory (glibc malloc): 200 000 entries of a 65-byte body
/// with one header took about 800 bytes each, of which about 205 are counted bytes.
const ENTRY_OVERHEAD: u64 = 576;

/// The memory a recorded header costs besides its name and value: its two allocations.
const HEADER_OVERHEAD: u64 = 48;

impl ReplayCache {
    /// A cache of at most `max_entries` responses and about `max_bytes` bytes; both must be
    /// positive.
    pub fn new(max_entries: usize, max_bytes: u64) -> Result<Self, EmptyCache> {
        if max_entries == 0 || max_bytes == 0 {
            return Err(EmptyCache);
        }
        Ok(Self {
            entries: Arc::new(Cache::with_weighter(max_entries, max_bytes, ByWeight)),
            max_entries,
            max_bytes,
        })
    }

    /// How many responses it holds.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The bytes it holds, as weighed against its byte limit.
    pub fn weight(&self) -> u64 {
        self.entries.weight()
    }

    pub(crate) fn get(&self, identity: &MessageIdentity) -> Option<Arc<Cached>> {
        self.entries.get(identity)
    }

    /// Keeps a committed record. Records without a response are not kept: there is
    /// nothing to replay from memory.
    pub(crate) fn insert(
        &self,
        identity: &MessageIdentity,
        fingerprint: Fingerprint,
        entry: InboxEntry,
    ) {
        let Some(response) = &entry.response else {
            return;
        };
        let bytes = ENTRY_OVERHEAD
            + (entry.payload_sha256.len() + entry.handler_version.len()) as u64
            + response.body.len() as u64
            + response
                .headers
                .iter()
                .map(|(n, v)| HEADER_OVERHEAD + (n.len() + v.len()) as u64)
                .sum::<u64>()
            + (identity.consumer().len()
                + identity.producer().name().len()
                + identity.tenant_column().len()
                + identity.message_id().as_str().len()) as u64;
        let floor = self.max_bytes / self.max_entries as u64;
        let weight = bytes.max(floor).max(1);
        let cached = Arc::new(Cached {
            fingerprint,
            entry,
            weight,
        });
        self.entries.insert(identity.clone(), cached);
    }
}

impl std::fmt::Debug for ReplayCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplayCache")
            .field("len", &self.len())
            .field("weight", &self.weight())
            .field("max_entries", &self.max_entries)
            .field("max_bytes", &self.max_bytes)
            .finish()
    }
}
