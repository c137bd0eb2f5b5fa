//! Where the producer scope of a request comes from.
//!
//! A recorded response belongs to the producer that caused it, so the producer is part of
//! the message identity: the same key from two producers is two commands, and one client can
//! never be replayed another's response. The layer has no default scope on purpose; pick one:
//!
//! * [`FromExtension`] (recommended): read what the application's authentication middleware
//!   put in the request extensions.
//! * [`TrustedHeader`]: a header set by a gateway that authenticates clients and strips the
//!   header from what they send. Never use it where clients reach the service directly.
//! * [`ConstantProducer`]: a single producer, e.g. one internal caller.
//!
//! Or implement [`ProducerScope`] yourself, as tower_governor lets you plug a key extractor.

use std::fmt;
use std::marker::PhantomData;

use http::header::HeaderName;
use http::request::Parts;

use crate::identity::{Producer, ProducerError};

/// Extracts the producer scope from a request.
///
/// ```
/// use http::request::Parts;
/// use tower_inbox::{Producer, ProducerError};
/// use tower_inbox::producer::{ProducerScope};
///
/// /// The client certificate's subject, put there by the TLS terminator.
/// struct ClientCertSubject;
///
/// impl ProducerScope for ClientCertSubject {
///     fn producer(&self, parts: &Parts) -> Result<Producer, ProducerError> {
///         let subject = parts
///             .headers
///             .get("x-client-cert-subject")
///             .and_then(|v| v.to_str().ok())
///             .ok_or_else(|| ProducerError::new("no client certificate"))?;
///         Producer::new(subject)
///     }
/// }
/// ```
pub trait ProducerScope: Send + Sync + 'static {
    /// The producer of this request, or why there is none.
    fn producer(&self, parts: &Parts) -> Result<Producer, ProducerError>;
}

impl<F> ProducerScope for F
where
    F: Fn(&Parts) -> Result<Producer, ProducerError> + Send + Sync + 'static,
{
    fn producer(&self, parts: &Parts) -> Result<Producer, ProducerError> {
        self(parts)
    }
}

/// The producer taken from a request extension of type `T`, mapped by a function.
///
/// ```
/// use tower_inbox::{producer::FromExtension, Producer};
///
/// #[derive(Clone)]
/// struct AuthenticatedClient { client_id: String }
///
/// let scope = FromExtension::new(|c: &AuthenticatedClient| Producer::new(c.client_id.clone()));
/// # let _ = scope;
/// ```
pub struct FromExtension<T, F> {
    map: F,
    _marker: PhantomData<fn(&T)>,
}

impl<T, F> FromExtension<T, F>
where
    T: Send + Sync + 'static,
    F: Fn(&T) -> Result<Producer, ProducerError> + Send + Sync + 'static,
{
    /// Reads `T` from the extensions and maps it to a producer.
    pub fn new(map: F) -> Self {
        Self {
            map,
            _marker: PhantomData,
        }
    }
}

impl<T, F> ProducerScope for FromExtension<T, F>
where
    T: Send + Sync + 'static,
    F: Fn(&T) -> Result<Producer, ProducerError> + Send + Sync + 'static,
{
    fn producer(&self, parts: &Parts) -> Result<Producer, ProducerError> {
        let value = parts.extensions.get::<T>().ok_or_else(|| {
            ProducerError::new("the request is not authenticated (no client identity)")
        })?;
        (self.map)(value)
    }
}

impl<T, F> fmt::Debug for FromExtension<T, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FromExtension<{}>", std::any::type_name::<T>())
    }
}

/// The producer named by a header that a trusted gateway sets.
///
/// Only safe when every request passes a gateway that authenticates the client and
/// overwrites this header: a client that can set it can read another client's recorded
/// responses by guessing their keys.
///
/// ```
/// use tower_inbox::producer::TrustedHeader;
/// let scope = TrustedHeader::new("x-producer");
/// # let _ = scope;
/// ```
#[derive(Debug, Clone)]
pub struct TrustedHeader {
    name: HeaderName,
}

impl TrustedHeader {
    /// Reads the producer from header `name`.
    ///
    /// # Panics
    ///
    /// If `name` is not a valid header name; this is a programming error caught at start-up.
    pub fn new(name: &'static str) -> Self {
        Self {
            name: HeaderName::from_static(name),
        }
    }

    /// Reads the producer from header `name`.
    pub fn from_header_name(name: HeaderName) -> Self {
        Self { name }
    }
}

impl ProducerScope for TrustedHeader {
    fn producer(&self, parts: &Parts) -> Result<Producer, ProducerError> {
        let mut values = parts.headers.get_all(&self.name).iter();
        let value = values
            .next()
            .ok_or_else(|| ProducerError::new(format!("the {} header is missing", self.name)))?;
        if values.next().is_some() {
            return Err(ProducerError::new(format!(
                "the {} header was sent more than once",
                self.name
            )));
        }
        let value = value.to_str().map_err(|_| {
            ProducerError::new(format!("the {} header is not visible ASCII", self.name))
        })?;
        Producer::new(value.trim())
    }
}

/// One fixed producer for every request: for a service with a single trusted caller.
#[derive(Debug, Clone)]
pub struct ConstantProducer(Producer);

impl ConstantProducer {
    /// Every request is from `producer`.
    pub fn new(producer: Producer) -> Self {
        Self(producer)
    }
}

impl ProducerScope for ConstantProducer {
    fn producer(&self, _parts: &Parts) -> Result<Producer, ProducerError> {
        Ok(self.0.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(build: impl FnOnce(http::request::Builder) -> http::request::Builder) -> Parts {
        build(http::Request::builder())
            .body(())
            .unwrap()
            .into_parts()
            .0
    }

    #[test]
    fn trusted_header_reads_one_value() {
        let scope = TrustedHeader::new("x-producer");
        let p = scope
            .producer(&parts(|b| b.header("x-producer", "app-1")))
            .unwrap();
        assert_eq!(p.name(), "app-1");
        assert!(scope.producer(&parts(|b| b)).is_err());
        assert!(scope
            .producer(&parts(|b| b.header("x-producer", "")))
            .is_err());
        assert!(scope
            .producer(&parts(|b| b
                .header("x-producer", "a")
                .header("x-producer", "b")))
            .is_err());
    }

    #[test]
    fn extension_scope_needs_the_extension() {
        #[derive(Clone)]
        struct Client(&'static str);
        let scope = FromExtension::new(|c: &Client| Producer::new(c.0));
        assert!(scope.producer(&parts(|b| b)).is_err());
        let p = scope
            .producer(&parts(|b| b.extension(Client("svc-a"))))
            .unwrap();
        assert_eq!(p.name(), "svc-a");
    }

    #[test]
    fn closures_are_scopes() {
        let scope = |_: &Parts| Producer::new("only");
        assert_eq!(scope.producer(&parts(|b| b)).unwrap().name(), "only");
    }
}
