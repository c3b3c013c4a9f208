//! [`Cause`]: why a request failed or the engine stopped serving, kept as
//! the runtime's own typed error (not its message) and shared by every
//! request that one fault fails.
//!
//! It is transparent: it displays as the error it holds and continues that
//! error's `source()` chain, so whoever wraps it (`EngineError`, a gRPC
//! status, the CLI) prints the whole chain once, with nothing flattened.

use std::error::Error;
use std::fmt;
use std::sync::Arc;

/// A shared, typed failure cause.
#[derive(Clone)]
pub struct Cause(Arc<dyn Error + Send + Sync + 'static>);

/// A cause the pipeline itself finds (a broken protocol, a lost reply).
#[derive(Debug)]
struct Message(String);

impl fmt::Display for Message {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Error for Message {}

impl Cause {
    /// Wraps a typed error.
    pub fn new(e: impl Error + Send + Sync + 'static) -> Self {
        Self(Arc::new(e))
    }

    /// A cause with only a message, for faults the pipeline detects itself.
    pub fn message(msg: impl Into<String>) -> Self {
        Self(Arc::new(Message(msg.into())))
    }

    /// The error this cause holds (to downcast it).
    pub fn get(&self) -> &(dyn Error + Send + Sync + 'static) {
        &*self.0
    }
}

impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl fmt::Debug for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl Error for Cause {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.0.source()
    }
}

/// Two causes are equal when they are the same fault (one shared error),
/// never by what they say: two faults with the same message are two faults.
impl PartialEq for Cause {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("outer")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn a_cause_keeps_the_chain_of_the_error_it_holds() {
        let c = Cause::new(Outer(std::io::Error::other("inner")));
        assert_eq!(c.to_string(), "outer");
        assert_eq!(
            c.source().map(ToString::to_string).as_deref(),
            Some("inner")
        );
        assert!(c.get().downcast_ref::<Outer>().is_some());
        assert_eq!(c.clone(), c);
        assert_ne!(Cause::message("x"), Cause::message("x"));
    }
}
