//! Message identity: who consumes, which producer's intent, which message.

use std::fmt;
use std::sync::Arc;

use crate::key::MessageKey;

/// The longest producer or tenant name accepted, in bytes.
pub const MAX_SCOPE_LEN: usize = 255;

/// The producer-name prefix of the claims a
/// [compensated migration](crate::replay::CompensatedMigration) makes; [`Producer::new`]
/// refuses it, so no client can claim (or read) a migration's steps.
pub(crate) const RESERVED_PRODUCER_PREFIX: &str = "migration:";

/// Whether `name` is a consumer name: 1 to 255 bytes of ASCII letters, digits and `-`, `_`,
/// `.`, `:`, `/`, `@`. Consumer names are
/// configuration, not input, and appear in metric labels and logs: a small alphabet keeps them
/// readable and the same in every encoding.
pub(crate) fn is_consumer_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.:/@".contains(&b))
}

/// Whether `version` is a handler version: 1 to 255 visible ASCII characters (`!` to `~`).
pub(crate) fn is_handler_version(version: &str) -> bool {
    !version.is_empty() && version.len() <= 255 && version.bytes().all(|b| b.is_ascii_graphic())
}

/// The producer scope of a message: whose intent it carries. Message IDs from different
/// producers may collide, so the producer is part of the identity; a recorded response is only
/// ever replayed to the producer that caused it.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Producer {
    name: String,
    tenant: Option<String>,
}

/// A producer or tenant name that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid producer scope: {0}")]
pub struct ProducerError(pub(crate) String);

impl ProducerError {
    /// A reason the producer scope is not available, shown to the client as the problem's
    /// `detail`. Keep it free of secrets.
    pub fn new(reason: impl Into<String>) -> Self {
        Self(reason.into())
    }
}

impl Producer {
    /// A producer scope with a name of 1 to [`MAX_SCOPE_LEN`] bytes and no control characters,
    /// not starting with `migration:` (the prefix of a compensated migration's steps,
    /// [`MIGRATION_PRODUCER_PREFIX`](crate::replay::MIGRATION_PRODUCER_PREFIX)).
    ///
    /// ```
    /// use tower_inbox::Producer;
    /// let p = Producer::new("billing-service").unwrap().with_tenant("acme").unwrap();
    /// assert_eq!(p.name(), "billing-service");
    /// assert_eq!(p.tenant(), Some("acme"));
    /// assert!(Producer::new("").is_err());
    /// assert!(Producer::new("migration:bonus-fix").is_err());
    /// ```
    pub fn new(name: impl Into<String>) -> Result<Self, ProducerError> {
        let name = name.into();
        check_scope_name("producer", &name)?;
        if name.starts_with(RESERVED_PRODUCER_PREFIX) {
            return Err(ProducerError(format!(
                "producer names starting with '{RESERVED_PRODUCER_PREFIX}' are reserved for \
                 compensated migrations"
            )));
        }
        Ok(Self { name, tenant: None })
    }

    /// The producer a compensated migration's steps are claimed under:
    /// `migration:<name>`.
    pub(crate) fn migration(name: &str) -> Result<Self, ProducerError> {
        let name = format!("{RESERVED_PRODUCER_PREFIX}{name}");
        check_scope_name("producer", &name)?;
        Ok(Self { name, tenant: None })
    }

    /// Adds a tenant, for producers whose message IDs are unique only inside a tenant.
    pub fn with_tenant(mut self, tenant: impl Into<String>) -> Result<Self, ProducerError> {
        let tenant = tenant.into();
        check_scope_name("tenant", &tenant)?;
        self.tenant = Some(tenant);
        Ok(self)
    }

    /// The producer's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The tenant, if the scope has one.
    pub fn tenant(&self) -> Option<&str> {
        self.tenant.as_deref()
    }
}

impl fmt::Debug for Producer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.tenant {
            Some(t) => write!(f, "Producer({}/{})", self.name, t),
            None => write!(f, "Producer({})", self.name),
        }
    }
}

fn check_scope_name(what: &str, name: &str) -> Result<(), ProducerError> {
    if name.is_empty() {
        return Err(ProducerError(format!("the {what} name is empty")));
    }
    if name.len() > MAX_SCOPE_LEN {
        return Err(ProducerError(format!(
            "the {what} name is longer than {MAX_SCOPE_LEN} bytes"
        )));
    }
    if name.chars().any(char::is_control) {
        return Err(ProducerError(format!(
            "the {what} name contains a control character"
        )));
    }
    Ok(())
}

/// Binds an identity's key columns `(consumer, producer, tenant, message ID)`, in primary-key
/// order, to the query's next four parameters: the names as UTF-8 bytes, which the statements
/// decode (`utf8!` in `inbox/sql.rs`), so no session's `client_encoding` can change them; the
/// message ID, always visible ASCII, as text.
macro_rules! bind_identity {
    ($query:expr, $identity:expr) => {{
        let [consumer, producer, tenant, message_id] =
            $crate::identity::MessageIdentity::key_parts($identity);
        $query
            .bind(consumer.as_bytes())
            .bind(producer.as_bytes())
            .bind(tenant.as_bytes())
            .bind(message_id)
    }};
}
pub(crate) use bind_identity;

/// The full identity of one message: `(consumer, producer, tenant, message ID)`, the inbox's
/// primary key.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct MessageIdentity {
    consumer: Arc<str>,
    /// Shared by the identity's clones: a guarded request clones its identity several times
    /// (the claim, the attempt, the failure record), and copying the producer's name and the
    /// key each time cost 8 heap allocations per request (`benches/instructions.sh`).
    sent: Arc<Sent>,
}

/// Who sent a message, and its ID.
#[derive(PartialEq, Eq, Hash)]
struct Sent {
    producer: Producer,
    message_id: MessageKey,
}

impl MessageIdentity {
    /// An identity from its parts.
    ///
    /// ```
    /// use tower_inbox::{MessageIdentity, MessageKey, Producer};
    /// let id = MessageIdentity::new(
    ///     "credits",
    ///     Producer::new("mobile-app").unwrap(),
    ///     MessageKey::new("7b0e7a").unwrap(),
    /// );
    /// assert_eq!(id.to_string(), "credits/mobile-app/7b0e7a");
    /// ```
    pub fn new(consumer: impl Into<Arc<str>>, producer: Producer, message_id: MessageKey) -> Self {
        Self {
            consumer: consumer.into(),
            sent: Arc::new(Sent {
                producer,
                message_id,
            }),
        }
    }

    /// The consumer name: who applies the message.
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// The consumer name as the identity shares it with its clones.
    pub(crate) fn consumer_shared(&self) -> &Arc<str> {
        &self.consumer
    }

    /// The producer scope: whose intent it is.
    pub fn producer(&self) -> &Producer {
        &self.sent.producer
    }

    /// The producer-assigned message (command) ID.
    pub fn message_id(&self) -> &MessageKey {
        &self.sent.message_id
    }

    /// The primary key's values, in its column order: consumer, producer, tenant column,
    /// message ID.
    pub(crate) fn key_parts(&self) -> [&str; 4] {
        [
            self.consumer(),
            self.producer().name(),
            self.tenant_column(),
            self.message_id().as_str(),
        ]
    }

    /// The tenant as stored: `''` when the producer has none.
    pub(crate) fn tenant_column(&self) -> &str {
        self.producer().tenant().unwrap_or("")
    }
}

impl fmt::Debug for MessageIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MessageIdentity({self})")
    }
}

impl fmt::Display for MessageIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.producer().tenant() {
            Some(t) => write!(
                f,
                "{}/{}/{}/{}",
                self.consumer,
                self.producer().name(),
                t,
                self.message_id()
            ),
            None => write!(
                f,
                "{}/{}/{}",
                self.consumer,
                self.producer().name(),
                self.message_id()
            ),
        }
    }
}
