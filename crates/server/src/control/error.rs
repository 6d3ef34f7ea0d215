//! Why the control plane refused a request: a kind a script can act on and the one-line
//! reason a person reads. On the socket: `{"ok": false, "error": REASON, "kind": KIND}`.

use serde::{Deserialize, Serialize};

/// What kind of refusal (`kind` on the socket, snake_case).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The request is malformed or a value in it is not acceptable (a bad number, name,
    /// rule, state or size).
    Invalid,
    /// What it names does not exist (a target, a LUN, a portal, a group, a node).
    NotFound,
    /// What it would add is already there.
    Exists,
    /// Refused in the current state (a target with sessions, a node still answering).
    Busy,
    /// This server cannot do it (no cluster, no configuration syntax to build from).
    Unsupported,
    /// It was tried and failed (a file, a backend, the cluster).
    Failed,
}

/// A refused control request.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[error("{message}")]
pub struct ControlError {
    pub kind: ErrorKind,
    pub message: String,
}

impl ControlError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        ControlError {
            kind,
            message: message.into(),
        }
    }
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Invalid, message)
    }
    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::NotFound, message)
    }
    pub fn exists(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Exists, message)
    }
    pub fn busy(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Busy, message)
    }
    pub fn unsupported(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Unsupported, message)
    }
    pub fn failed(message: impl Into<String>) -> Self {
        Self::new(ErrorKind::Failed, message)
    }
}

/// A reason from code below the control plane (a parser, a check, the cluster), whose kind
/// is not known here: `failed`, unless the caller names a better one.
impl From<String> for ControlError {
    fn from(message: String) -> Self {
        ControlError::failed(message)
    }
}

/// For callers that only carry a reason (the configuration reconciler's change list).
impl From<ControlError> for String {
    fn from(e: ControlError) -> Self {
        e.message
    }
}

impl From<&str> for ControlError {
    fn from(message: &str) -> Self {
        ControlError::failed(message)
    }
}
