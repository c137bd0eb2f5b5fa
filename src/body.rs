//! The body type the layer speaks, so that it works with any Tower HTTP stack, not only axum.
//!
//! The inner service receives its request with a [`Body`] (the guarded request's body was
//! buffered to fingerprint it), and the layer's responses carry one: the inner service's own
//! body passed through, or bytes the layer holds (a replay, a problem).

use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};

/// The error type of a [`Body`]: whatever the body it wraps failed with.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// An HTTP body of [`Bytes`] frames: bytes in memory or another body, boxed.
///
/// ```
/// use http_body::Body as _;
/// use tower_inbox::body::Body;
///
/// let body = Body::from("created");
/// assert_eq!(body.size_hint().exact(), Some(7));
/// ```
pub struct Body(UnsyncBoxBody<Bytes, BoxError>);

impl Body {
    /// Wraps any body whose frames are [`Bytes`].
    pub fn new<B>(body: B) -> Self
    where
        B: http_body::Body<Data = Bytes> + Send + 'static,
        B::Error: Into<BoxError>,
    {
        Self(body.map_err(Into::into).boxed_unsync())
    }

    /// A body with no bytes.
    pub fn empty() -> Self {
        Self::from(Bytes::new())
    }
}

impl Default for Body {
    fn default() -> Self {
        Self::empty()
    }
}

impl std::fmt::Debug for Body {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Body").finish_non_exhaustive()
    }
}

impl From<Bytes> for Body {
    fn from(bytes: Bytes) -> Self {
        Self::new(Full::new(bytes))
    }
}

impl From<Vec<u8>> for Body {
    fn from(bytes: Vec<u8>) -> Self {
        Self::from(Bytes::from(bytes))
    }
}

impl From<String> for Body {
    fn from(text: String) -> Self {
        Self::from(Bytes::from(text))
    }
}

impl From<&'static str> for Body {
    fn from(text: &'static str) -> Self {
        Self::from(Bytes::from_static(text.as_bytes()))
    }
}

impl http_body::Body for Body {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        Pin::new(&mut self.0).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.0.size_hint()
    }
}
